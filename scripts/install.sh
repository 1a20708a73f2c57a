#!/usr/bin/env bash
# Installs hapt_hf (editable) and, with the argument "test", its test extras at the versions the
# test suite ran on (scripts/constraints-test.txt); without it, at pyproject.toml's ranges.
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
if [ -z "$extras" ]; then
  "$PY" -m pip install -q -e .
elif "$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
  # the installed torch is pinned to itself so that no pin of the file makes pip replace it
  torch_pin=$(mktemp)
  trap 'rm -f "$torch_pin"' EXIT
  "$PY" -c "import importlib.metadata as m; d = m.distribution('torch'); print('torch==' + d.version)" \
    > "$torch_pin" 2>/dev/null || : > "$torch_pin"
  "$PY" -m pip install -q -e ".${extras}" -c scripts/constraints-test.txt -c "$torch_pin"
else
  echo "install.sh: scripts/constraints-test.txt holds Python 3.11 releases; on $("$PY" -V)" \
    "the test extras are installed at pyproject.toml's ranges" >&2
  "$PY" -m pip install -q -e ".${extras}"
fi
