#!/usr/bin/env bash
# The unit tests on Python 3.12, in a venv of the base package and the test extra (no engine extra: PyPI's torch
# for 3.12 is the multi-GB CUDA build; tests/unit/conftest.py leaves out the tests that need it). Called by .ci/run;
# skipped in one line where no python3.12 is installed. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=""
# a pyenv shim answers `command -v` without a 3.12 selected: take the first candidate that runs
for candidate in "$(command -v python3.12 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys" >/dev/null 2>&1; then
    PY312=$candidate
    break
  fi
done
if [ -z "$PY312" ]; then
  echo "python3.12 not found: the Python 3.12 unit tests are skipped"
  exit 0
fi
if [ ! -x .venv-py312/bin/python ]; then
  "$PY312" -m venv .venv-py312
fi
.venv-py312/bin/python -m pip install -q --upgrade pip
.venv-py312/bin/python -m pip install -q -c deploy/constraints.txt -e ".[test,flower]"
# shellcheck source=scripts/services.sh
source scripts/services.sh
ensure_services || exit 1
exec .venv-py312/bin/python -m pytest -q -p no:cacheprovider tests/unit "$@"
