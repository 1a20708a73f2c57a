#!/usr/bin/env bash
# Installs hapt_hf (editable) and, with the argument "test", its test extras.
# PyTorch: an existing install is kept. Without one, a machine with no NVIDIA GPU gets a CPU
# build (a local CPU wheel where pip finds one, else PyTorch's CPU index), so that a CPU-only
# machine never downloads gigabytes of CUDA packages; a GPU machine gets the regular build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "test" ] && extras="[test]"

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q "torch==${HAPT_TORCH_CPU_VERSION:-2.13.0}" --only-binary=:all: 2>/dev/null \
      || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install -q -e ".${extras}"
