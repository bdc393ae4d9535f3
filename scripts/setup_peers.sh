#!/usr/bin/env bash
# Idempotently create the virtual environment that runs the published peer framework
# (pyplait, which needs Python 3.13) for scripts/bench_pipeline.py.
#
#   bash scripts/setup_peers.sh            # creates/updates .venv-pyplait in the repo root
#   PYPLAIT_VENV=/some/where bash scripts/setup_peers.sh
#
# Env vars:
#   PYPLAIT_VENV     where the venv lives (default: <repo>/.venv-pyplait)
#   PYPLAIT_PYTHON   a Python 3.13 interpreter (default: pyenv's 3.13.0, else python3.13 on PATH)
#
# Python 3.13's venv module writes a `.gitignore` containing `*` inside the venv, so the
# folder is ignored by git without touching the repository's .gitignore.
set -euo pipefail

PYPLAIT_VERSION="2026.1.1"
PSUTIL_SPEC="psutil>=5.9,<8"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PYPLAIT_VENV:-$repo_root/.venv-pyplait}"

find_python() {
    if [[ -n "${PYPLAIT_PYTHON:-}" ]]; then
        echo "$PYPLAIT_PYTHON"; return
    fi
    local candidates=(
        "${PYENV_ROOT:-/root/.pyenv}/versions/3.13.0/bin/python3.13"
        "$(command -v python3.13 || true)"
    )
    local p
    for p in "${candidates[@]}"; do
        if [[ -n "$p" && -x "$p" ]]; then echo "$p"; return; fi
    done
    # any pyenv 3.13.x
    for p in "${PYENV_ROOT:-/root/.pyenv}"/versions/3.13.*/bin/python3.13; do
        if [[ -x "$p" ]]; then echo "$p"; return; fi
    done
    echo "setup_peers: no Python 3.13 found (set PYPLAIT_PYTHON)" >&2
    exit 1
}

vpy="$venv/bin/python"

# Reuse an existing venv only if it really is Python 3.13.
if [[ -x "$vpy" ]] && ! "$vpy" -c 'import sys; raise SystemExit(sys.version_info[:2] != (3, 13))' 2>/dev/null; then
    echo "setup_peers: $venv is not a Python 3.13 venv; recreating" >&2
    rm -rf "$venv"
fi

if [[ ! -x "$vpy" ]]; then
    py="$(find_python)"
    echo "setup_peers: creating $venv with $py" >&2
    "$py" -m venv "$venv"
fi

# Already satisfied? Then do nothing (no network).
if "$vpy" - "$PYPLAIT_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
ok = version("pyplait") == sys.argv[1]
import psutil  # noqa: F401
raise SystemExit(0 if ok else 1)
PY
then
    echo "setup_peers: pyplait $PYPLAIT_VERSION already installed in $venv" >&2
    exit 0
fi

"$vpy" -m pip install --quiet --disable-pip-version-check \
    "pyplait==$PYPLAIT_VERSION" "$PSUTIL_SPEC"
echo "setup_peers: installed pyplait $PYPLAIT_VERSION into $venv" >&2
