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
MAX_MODULE_LINES = 1000


def test_no_module_holds_two_ideas_by_size() -> None:
    too_big = []
    for package in ("hashing", "omnicache"):
        for path in sorted((ROOT / package).rglob("*.py")):
            num_lines = len(path.read_text().splitlines())
            if num_lines > MAX_MODULE_LINES:
                too_big.append(f"{_module_name(path)}: {num_lines} lines")
    assert too_big == []
