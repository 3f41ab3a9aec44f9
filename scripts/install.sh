#!/usr/bin/env bash
# Create .venv and install flashsys with its test and Hugging Face extras.
#
# Why a script: a bare `torch` requirement on a machine with no torch pulls several GB of CUDA wheels.
# On a machine without a GPU we install the CPU build of torch first, so the later `pip install -e .`
# finds its torch requirement already satisfied. Where torch is already importable by the chosen Python
# (a GPU machine with its own torch), the venv inherits it via --system-site-packages and nothing is
# reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
CPU_TORCH=${FLASHSYS_CPU_TORCH:-torch==2.13.0}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import flashsys, torch, pytest, hypothesis, transformers" 2>/dev/null \
   && [ "$VENV/.stamp" -nt pyproject.toml ]; then
  exit 0
fi

if "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] using the torch already installed for $PY: $("$PY" -c 'import torch; print(torch.__version__)')"
  "$PY" -m venv --system-site-packages "$VENV"
else
  "$PY" -m venv "$VENV"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] GPU found: installing torch with CUDA from the package index"
    "$VENV/bin/python" -m pip install -q torch
  else
    echo "[install] no GPU: installing the CPU build ($CPU_TORCH)"
    "$VENV/bin/python" -m pip install -q "$CPU_TORCH"
  fi
fi
"$VENV/bin/python" -m pip install -q -e ".[test,hf]"
touch "$VENV/.stamp"
echo "[install] done: $("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
