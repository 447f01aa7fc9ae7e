#!/usr/bin/env bash
# Install vLLM 0.33.0's scheduler-side Python into its own virtual environment,
# without its CUDA stack, for the integration tests and side-by-side benchmarks.
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]   (default: .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# vLLM goes in without its declared requirements (below), so pip would list
# each of them as a conflict after every install: --no-warn-conflicts.
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts)
"${pip[@]}" -c constraints.txt torch
"${pip[@]}" --no-deps vllm==0.33.0
# vLLM's own requirements would pull a CUDA build of torch; these are the
# packages its scheduler-side code needs, at versions checked together.
"${pip[@]}" -c constraints.txt \
  packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 regex==2026.11.19 \
  numpy==2.4.6 msgspec==0.23.0 pydantic==2.14.4 cbor2==6.3.0 transformers==5.24.0 \
  aiohttp==3.14.5 requests==2.34.2 openai-harmony==0.0.8 openai==3.57.0 pillow==13.0.0 \
  pybase64==1.5.1 cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 \
  prometheus_client==0.26.0 xgrammar==0.2.9 fastapi==0.165.0 \
  partial-json-parser==0.2.1.1.post7 llguidance==1.9.1
"${pip[@]}" -c constraints.txt -e '.[test]'
"$venv/bin/python" -c 'import vllm, omnicache; print("vllm", vllm.__version__)'
