"""The device script's checks pass on the CPU, the device's path of the worker's store included.

`benchmarks/gpu_store_check.py` is run on a CUDA machine when one is lent,
once: its logic is checked here, where every run can, so that a run there
fails only on what a device does differently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    # NOTE: CPU-only mode, whatever the machine has.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_store_check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_device_script_passes_its_checks_on_the_cpu() -> None:
    result = run_script("--tokens", "512", "--hidden", "64", "--reps", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "torch" in lines[0] and lines[0].endswith("no CUDA: CPU-only mode")
    # The store's 20 checks; the worker's store's 3 as on the CPU, and its 4 as
    # on a device (copies of each step's rows and slots, told before each
    # forward pass), where the staged rows are written before the hit reads them.
    assert "correctness: 27 checks, 0 mismatches" in lines
    assert "MISMATCH" not in result.stdout
    assert lines[-1] == "all checks passed"
