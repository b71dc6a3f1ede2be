#!/usr/bin/env bash
# Installs the project with its test tools, then runs ruff, mypy over the packages
# (inference/wire included), the module-size check and the whole pytest suite. The
# README's second command and .ci/run both call this.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# torch first and pinned: otherwise a dependency pulls a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[dev]"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy inference skyrl_train skyrl_gym
# Modules over 400 lines must say in their docstring why they are kept whole.
"$PY" scripts/check_module_size.py
# vLLM runs from its own venv (about 3 min and 3.5 GB the first time, seconds after).
bash scripts/install_vllm.sh
"$PY" -m pytest -q "$@"
