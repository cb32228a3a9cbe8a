#!/usr/bin/env bash
# Installs what the project needs into the current Python environment:
# torch (the CPU build 2.13.0 unless some torch is already installed), then this
# package in editable mode with its test extras (compiles the C++ dataset helpers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  $PY -m pip install -q torch==2.13.0
fi
echo "[setup] installing megatron (editable) and test dependencies"
$PY -m pip install -q -e ".[test]" 2>&1 | grep -v "Running pip as the 'root' user" || true
$PY -c "import megatron, torch; from megatron.data import helpers; print('[setup] ok: torch', torch.__version__)"
