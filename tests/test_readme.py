"""The README's API example runs and prints exactly what the README shows; the tests
SECURITY.md names exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_example_prints_what_the_readme_shows() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## API in five lines", 1)[1].split("\n## ", 1)[0]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.DOTALL)[:2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    assert result.stdout == shown


def test_readme_opens_with_the_two_commands() -> None:
    first_block = (ROOT / "README.md").read_text().split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["./dev demo", "./dev test"]


def test_every_test_security_md_names_exists() -> None:
    """SECURITY.md's threat table names the tests that show each threat: they must exist."""
    text = (ROOT / "SECURITY.md").read_text()
    named = set(re.findall(r"`(tests/test_\w+\.py)(?:::(\w+))?`", text))
    assert len(named) >= 20
    for path, name in sorted(named):
        module = ROOT / path
        assert module.is_file(), path
        if name:
            functions = {
                node.name
                for node in ast.walk(ast.parse(module.read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            assert name in functions, f"{path}::{name}"
