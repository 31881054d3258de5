#!/usr/bin/env bash
# Creates ./.venv with this package and its pinned CPU dependencies (torch==2.13.0 CPU build).
# Idempotent: re-running only installs what changed. GPU machines use docker/ instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# PYTHONWARNINGS reaches the build backend: setuptools' "Editable installation" notice (a banner
# about folders shadowing the package) is not for this repository's users.
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
# SGLang 0.5.23's wheel (source only, never installed): tests/rollout/test_sglang_contract.py
# checks the client and tests/standins/test_cpu_worker_sglang_contract.py the CPU worker against
# it. Keep in step with rollout/sglang_version.py.
SGLANG_WHEEL_DIR=.cache/sglang-wheel
if ! ls "$SGLANG_WHEEL_DIR"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
    .venv/bin/python -m pip download -q --no-deps sglang==0.5.23 -d "$SGLANG_WHEEL_DIR"
fi
echo "environment ready: $(pwd)/.venv"
