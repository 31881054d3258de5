#!/usr/bin/env bash
# Creates ./.venv with this package and its pinned CPU dependencies (torch==2.13.0 CPU build).
# Idempotent: re-running only installs what changed. GPU machines use docker/ instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
echo "environment ready: $(pwd)/.venv"
