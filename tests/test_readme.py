"""The README's API example runs and prints exactly what the README shows."""

from __future__ import annotations

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
