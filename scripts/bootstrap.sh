#!/usr/bin/env bash
# Creates .venv (once) and installs the package with its dev extras, offline-safe.
# torch: the pinned CPU build is installed first when the venv has no torch, so that no
# requirement can pull a multi-GB CUDA build; a torch already present is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$TORCH_PIN"
fi
# Keep whatever torch is installed: every later install is constrained to it.
"$PY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv/torch-constraint.txt
export DS_BUILD_OPS=0  # deepspeed from the sdist as pure Python; GPU users build its ops themselves
stamp=.venv/.installed-$(cat setup.cfg pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  "$PY" -m pip install -q -c .venv/torch-constraint.txt -e ".[dev]"
  touch "$stamp"
fi
