#!/usr/bin/env bash
# Run the test suite on this machine, whatever state it is in: install into .venv when it is missing
# (scripts/install.sh), start PostgreSQL and Redis when they are installed but stopped (scripts/services.sh), or
# say in one line what is missing. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import app, pytest" >/dev/null 2>&1; then
  echo "no usable .venv: installing (scripts/install.sh)"
  bash scripts/install.sh
fi
# shellcheck source=scripts/services.sh
source scripts/services.sh
ensure_services || exit 1
exec .venv/bin/python -m pytest -q "$@"
