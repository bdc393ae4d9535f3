#!/usr/bin/env bash
# Writes the secret files deploy/k8s/secrets/kustomization.yaml reads, with random values (48 hex digits, URL-safe),
# readable by you only. A file that exists is kept: delete it to rotate that value (the next apply rolls the pods
# that use it). The files are git-ignored; keep them out of version control.
set -euo pipefail
cd "$(dirname "$0")"
umask 077
random() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }
write() {
  if [ -e "$1" ]; then
    echo "kept    $1"
  else
    printf '%s\n' "$2" >"$1"
    echo "wrote   $1"
  fi
}
write postgres.env "password=$(random)"
write redis.env "password=$(random)"
write flower.env "password=$(random)"
write api-keys.env "keys=default:sk-$(random)"
