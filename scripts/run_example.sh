#!/usr/bin/env bash
# Install everything, then run the example fan-out pipeline over app/examples/reviews.jsonl against a local
# OpenAI-compatible server started on 127.0.0.1. Results go to out/review-compare.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p out
log=$(mktemp)
.venv/bin/python -m app.testing.fake_llm_server --host 127.0.0.1 --port 0 --latency 0.05 >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 100); do grep -q '^READY' "$log" && break; sleep 0.1; done
url=$(grep '^READY' "$log" | awk '{print $2}')
[ -n "$url" ] || { echo "the local server did not start:"; cat "$log"; exit 1; }
cat > out/resources.toml <<TOML
[endpoints.assistant]
provider = "openai"
model = "local-echo"
base_url = "$url"
api_key = "sk-local"
max_concurrent = 32
TOML
.venv/bin/inf-engine run review-compare --input app/examples/reviews.jsonl \
  --resources out/resources.toml --output out/review-compare.jsonl
head -n 3 out/review-compare.jsonl
