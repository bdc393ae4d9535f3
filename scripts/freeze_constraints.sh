#!/usr/bin/env bash
# Write deploy/constraints.txt from .venv (after scripts/install.sh): every installed distribution pinned, minus
# the project itself, triton (CUDA-only, removed on CPU) and torch's local build label (+cpu / +cu128), so that
# the same file constrains the CPU and the CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Versions the image and scripts/install.sh install (pip install -c deploy/constraints.txt ...): the environment CI"
  echo "# tested, frozen. Regenerate from a fresh scripts/install.sh with scripts/freeze_constraints.sh after an upgrade."
  echo "# triton is left out on purpose: xgrammar requires it for CUDA kernels only, and the CPU install removes it."
  .venv/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(inf-engine|triton|py-spy)==| @ ' | sed -E 's/\+[a-z0-9]+$//'
} > deploy/constraints.txt
echo "wrote deploy/constraints.txt ($(grep -c '==' deploy/constraints.txt) pins)"
