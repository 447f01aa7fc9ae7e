#!/usr/bin/env bash
# Add EleutherAI's lm-evaluation-harness (lm-eval, with its `api` extra: the
# `local-completions` model's HTTP clients) to the live engine's environment, for
# examples/lm_eval_scoring.py.
# Usage: scripts/install-lm-eval.sh [VENV_DIR]   (default: .venv-live)
#
# The rule: nothing already installed changes. Every installed distribution is a
# constraint at its installed version (pip freeze), beside the project's
# constraints.txt; pip adds lm-eval's dependencies around them or fails.
# With vLLM 0.32's live environment, pip resolves pytablewriter to 0.38.0: every
# newer release needs typepy[datetime], which caps python-dateutil below 3, and the
# environment holds python-dateutil 4.0.0 (pandas and matplotlib take it). lm-eval
# runs with it and writes its results and samples files in full; only its printed
# summary table shows the letters A to I in place of the column names (lm-eval sets
# the writer's `headers`, which pytablewriter 0.38 calls `header_list`).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-live}
python=("$venv/bin/python")
if [ ! -x "${python[0]}" ]; then
  echo "no environment at $venv: scripts/install-vllm-live.sh (or ./dev live) makes it" >&2
  exit 1
fi
installed=$(mktemp)
trap 'rm -f "$installed"' EXIT
"${python[@]}" -m pip freeze --exclude-editable >"$installed"
"${python[@]}" -m pip install -q --disable-pip-version-check \
  -c constraints.txt -c "$installed" 'lm-eval[api]==0.4.13'
"${python[@]}" -c 'import lm_eval, aiohttp, tenacity; print("lm-eval", lm_eval.__version__)'
