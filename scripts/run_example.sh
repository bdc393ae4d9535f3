#!/usr/bin/env bash
# Install everything, then run the example fan-out pipeline over app/examples/reviews.jsonl on the default model
# (SmolLM2-135M-Instruct) inside this process: no server, no API key. Results go to out/review-compare.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p out
.venv/bin/inf-engine run review-compare --input app/examples/reviews.jsonl --output out/review-compare.jsonl
head -n 3 out/review-compare.jsonl
