#!/usr/bin/env bash
# The long checks kept out of the test suite's 25-minute budget on the 2-core machine
# (tests marked by_hand; docs/testing.md lists them and why each is safe to run by
# hand): vLLM on two more families, the docs' vLLM command as written, vLLM's MoE reload
# bug caught by the served-weights check, Ctrl-C of a vLLM launch, FSDP launches of two
# more families, the real replay-off export, the launches at 4 and 8 trainer ranks
# (test_main_base_many_ranks.py, 3 min 58 s on the quiet machine), the whole 8-rank layout grid
# in every family (test_megatron_layout_grid.py, about 4), 1,000 sandboxed programs in a
# row leaving nothing behind (test_sandbox.py, about 20 s). About 13 minutes on 2 cores.
# Extra arguments go to pytest (-k NAME runs one).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m pytest -q -m by_hand "$@"
