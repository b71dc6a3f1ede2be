#!/usr/bin/env bash
# SkyRL's own environment tests (skyrl-gym 0.4.0's sdist) against this package's
# skyrl_gym, with no line changed: test_gsm8k, test_aime, test_sql, test_lcb and
# test_search. Needs PyPI (it downloads the sdist); docs/environments.md lists the
# deliberate differences. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m pip download -q skyrl-gym==0.4.0 --no-deps --no-binary :all: -d "$work"
tar xzf "$work"/skyrl_gym-0.4.0.tar.gz -C "$work"
mkdir "$work/tests"
cp "$work"/skyrl_gym-0.4.0/tests/test_{gsm8k,aime,sql,lcb,search}.py "$work/tests/"
# Run from the copy's folder so `import skyrl_gym` is this project's, not the sdist's.
cd "$work/tests"
OMP_NUM_THREADS=1 exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
