#!/usr/bin/env bash
# The engine's CUDA checks in one go, for a GPU machine that has PyTorch but no network (issue 16):
# the GPU tests (and the C decode layer's, on that machine's CPU), the decode-attention check against float64
# and the CUDA benchmark (bench_cuda.py). One test folder's files stay together on the command line: run after
# files of other folders, a file there did not find runtime/conftest.py's fixtures under the GPU image's pytest.
#
#   # here: the wheels the GPU image lacks, and the default model's config and tokenizer (no weights)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl pydantic ... gguf
#   .venv/bin/python scripts/bench_cuda.py --write-skeleton .gpu/smollm2
#   # there, with .whl and .gpu carried along:
#   bash scripts/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout "${GPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts= -rs \
    tests/unit/engine/runtime/test_cuda_graphs.py tests/unit/engine/runtime/test_decode_layer.py \
    tests/unit/engine/models/test_tiny_models.py tests/unit/engine/test_sampler.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
timeout 45 python3 scripts/check_decode_attention.py 2>&1 | tee "$out/decode_attention.log" | tail -15
timeout "${BENCH_S:-300}" python3 scripts/bench_cuda.py --model .gpu/smollm2 --json "$out/bench_cuda.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_cuda.log" | grep -v '^{'
