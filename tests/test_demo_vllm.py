"""``omnicache demo --engine vllm``: the synthetic trace through a live vLLM engine, end to end.

The command runs as a user runs it, in a child process with this
environment's python and this checkout's code, and must exit 0 with a table
that shows no mismatch and no stale read. Same conventions as
``test_vllm_live``: skipped without vLLM 0.32's live CPU engine, failed
instead under ``CI=true`` or ``OMNICACHE_REQUIRE_VLLM_LIVE=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm_live  # the gate: tests/conftest.py
NUM_REQUESTS = 24


def _row(out: str, name: str) -> list[str]:
    """The three columns of a table row (caching off, vLLM's caching, omnicache)."""
    match = re.search(rf"^  {re.escape(name)}  +(\S+)  +(\S+)  +(\S+)", out, re.MULTILINE)
    assert match is not None, f"no row {name!r} in:\n{out}"
    return list(match.groups())


def test_demo_serves_the_trace_through_a_live_engine_with_no_mismatch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnicache", "demo", "--engine", "vllm",
         "--requests", str(NUM_REQUESTS)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:] + out
    lines = out.splitlines()
    assert lines[0] == "omnicache demo --engine vllm"
    assert lines[1].startswith(f"trace: synthetic(seed=0, requests={NUM_REQUESTS}): ")
    assert "images in prompts" in lines[1] and "audio clips" in lines[1]
    assert re.search(r"^  stale reads +- +- +0   must be 0$", out, re.MULTILINE), out
    assert re.search(r"^  mismatches +- +- +0   must be 0$", out, re.MULTILINE), out
    # omnicache's keys hit exactly where vLLM's own do, and the KV cache was
    # too small for the trace: blocks were handed out again.
    off_hits, vllm_hits, omni_hits = _row(out, "hit tokens")
    assert off_hits == "0"
    assert omni_hits == vllm_hits
    assert int(omni_hits.replace(",", "")) > 0
    assert _row(out, "hit rate")[1] == _row(out, "hit rate")[2]
    assert int(_row(out, "blocks reused")[2].replace(",", "")) > 0
    assert _row(out, "prompt hidden states") == ["all", "none", "all"]
    assert lines[-1] == (
        "ok: every request's prompt hidden states matched caching off's; no stale read"
    )
    # vLLM's INFO log stays out of the table (VLLM_LOGGING_LEVEL defaults to ERROR).
    assert "INFO" not in out
