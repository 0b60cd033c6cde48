#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs mla-jax with its test, train and serve extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in "${PYTHON:-}" python3.13 python3.12 /root/.pyenv/versions/3.12.1/bin/python3 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "error: no Python >= 3.12 found (jax >= 0.11 needs it); set PYTHON=/path/to/python3.12" >&2
  return 1
}
if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,train,serve,plot]"
