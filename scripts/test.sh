#!/usr/bin/env bash
# Run the test suite (install first with scripts/install.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
