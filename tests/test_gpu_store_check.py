"""The device script's checks pass on the CPU, the device's path of the worker's store included.

`benchmarks/gpu_store_check.py` is run on a CUDA machine when one is lent,
once: its logic is checked here, where every run can, so that a run there
fails only on what a device does differently. That machine's image has
torch, numpy, pillow, tqdm and xxhash, and neither vLLM nor soundfile (nor
blake3, which the script's docstring has carried there): the script runs
here without those two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING_ON_THE_DEVICE = ("soundfile", "vllm")


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # NOTE: a module of each missing package's name that fails as a missing
    # one does, first on the path.
    for name in MISSING_ON_THE_DEVICE:
        (tmp_path / f"{name}.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n"
        )
    env = {
        **os.environ,
        # CPU-only mode, whatever the machine has.
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_store_check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_device_script_passes_its_checks_on_the_cpu_without_what_the_device_lacks(
    tmp_path: Path,
) -> None:
    result = run_script(tmp_path, "--tokens", "512", "--hidden", "64", "--reps", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "torch" in lines[0] and lines[0].endswith("no CUDA: CPU-only mode")
    # The store's 20 checks; the worker's store's 3 as on the CPU, and its 4 as
    # on a device (copies of each step's rows and slots, told before each
    # forward pass), where the staged rows are written before the hit reads them.
    assert "correctness: 27 checks, 0 mismatches" in lines
    assert "MISMATCH" not in result.stdout
    assert lines[-1] == "all checks passed"
