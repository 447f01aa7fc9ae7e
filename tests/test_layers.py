"""The architecture rules of docs/architecture.md, checked on the source itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import omnicache

ROOT = Path(__file__).resolve().parents[1]

# Layers from the bottom up; a module may import only its own layer or lower.
LAYERS = [
    ["hashing"],
    # Argument checks: imports nothing of the project.
    ["omnicache.checks"],
    # Media files opened as vLLM's server opens uploads: imports nothing of the project.
    ["omnicache.media"],
    # Items' identities: what a model's processor receives (over hashing and media).
    ["omnicache.identity"],
    ["omnicache.annotations"],
    ["omnicache.preprocess"],
    ["omnicache.block_hash"],
    ["omnicache.store"],
    # Beside the store: it knows them only through BlockTier.
    ["omnicache.tiers"],
    # Engines omnicache runs inside (vLLM): the only code that imports them.
    ["omnicache.integrations"],
    # Stages of a multi-stage model on the engines below (thinker -> talker).
    ["omnicache.pipeline"],
    # The reference engine: a block pool and prefix cache of omnicache's own, over
    # the block keys. Nothing of the library imports it (the store knows a pool
    # only by its eviction listeners), so it sits right under the demo, its user.
    ["omnicache.reference"],
    # The demo application: drives the layers below as a user would, on its own
    # reference engine or, with --engine vllm, on a live vLLM engine.
    ["omnicache.demo"],
    # The command line on top.
    ["omnicache.demo.cli", "omnicache.__main__"],
]


def _layer_of(module: str) -> int:
    """The layer of the most specific name that ``module`` is or lies under."""
    found = [
        (len(name), index)
        for index, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    if not found:
        raise AssertionError(f"{module} is in no layer of the architecture map")
    return max(found)[1]


def _project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ("hashing", "omnicache")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_imports_run_downward_only() -> None:
    violations = []
    for package in ("hashing", "omnicache"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            if module in ("hashing", "omnicache"):
                continue  # the package facades re-export every layer
            for imported in _project_imports(path):
                if imported in ("hashing", "omnicache"):
                    imported_layer = 0 if imported == "hashing" else len(LAYERS)
                else:
                    imported_layer = _layer_of(imported)
                if imported_layer > _layer_of(module):
                    violations.append(f"{module} imports {imported}")
    assert violations == []


def test_nothing_below_the_store_imports_torch() -> None:
    code = (
        "import sys\n"
        "import hashing, omnicache\n"
        "import omnicache.annotations, omnicache.preprocess, omnicache.block_hash\n"
        "import omnicache.media\n"
        # Above the store, but needs no torch either.
        "import omnicache.reference\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    assert result.stdout.strip() == "False"


def test_store_names_resolve_lazily() -> None:
    from omnicache.store import StaleBlockError, TensorStore

    assert omnicache.TensorStore is TensorStore
    assert omnicache.StaleBlockError is StaleBlockError
    missing = [name for name in omnicache.__all__ if not hasattr(omnicache, name)]
    assert missing == []
    try:
        omnicache.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert str(error) == "module 'omnicache' has no attribute 'NoSuchName'"
    else:
        raise AssertionError("an unknown name resolved")


def test_the_store_knows_no_tier_and_no_redis() -> None:
    code = (
        "import sys\n"
        "import omnicache, omnicache.store, omnicache.demo.engine, omnicache.tiers\n"
        "print(sorted(m for m in sys.modules if m == 'redis' or m.startswith('omnicache.tiers')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    assert result.stdout.strip() == "['omnicache.tiers']"


# A module is one idea, and an idea lives in one module (docs/architecture.md):
# a cohesive module of several hundred lines reads better than fragments that
# only make sense together. Past about this many lines, a second idea has
# moved in.
MAX_MODULE_LINES = 700


def test_no_module_holds_two_ideas_by_size() -> None:
    too_big = []
    for package in ("hashing", "omnicache"):
        for path in sorted((ROOT / package).rglob("*.py")):
            num_lines = len(path.read_text().splitlines())
            if num_lines > MAX_MODULE_LINES:
                too_big.append(f"{_module_name(path)}: {num_lines} lines")
    assert too_big == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (anywhere in it: a function's imports and
    those for annotations alike), each named as the file it is (a package: its __init__)."""
    modules = {
        _module_name(path): path
        for package in ("hashing", "omnicache")
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import module`` imports that module.
                found.update(
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                )
        graph[module] = {name for name in found if name in modules and name != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of an import graph: its strongly connected components of two or more
    modules (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_modules_import_each_other_in_a_circle() -> None:
    # NOTE: the package facades (``hashing``, ``omnicache``) re-export what lies
    # below them and nothing of the project imports them, so they close no circle.
    assert _circles(_module_graph()) == []


def test_a_circle_is_found_however_long() -> None:
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},
        "d": set(),
        "e": {"f"},
        "f": {"e", "d"},
        "g": {"a"},
    }
    assert _circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
