#!/usr/bin/env bash
# Creates .venv and installs megatron-dapo with everything the CPU job needs.
#   ./install.sh         the package, megatron-core and the logging extras
#   ./install.sh test    the same plus the test tools
# Idempotent: a second run only checks. Pins that matter are explained inline.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch 2.13.0 has a CPU build on the machines' local disk; an unpinned torch pulls a multi-GB
# CUDA build. Inside the NGC container torch is already there and this line is a no-op.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
$PIP install numpy "packaging>=24.2" psutil
# megatron-core 0.19.x declares Python >= 3.12 but runs on 3.11; its real dependencies are the
# three above (psutil is needed by dist-checkpoint save although the wheel does not declare it).
.venv/bin/python -c "import importlib.metadata as m; assert m.version('megatron-core').startswith('0.19.')" 2>/dev/null \
  || $PIP install --no-deps --ignore-requires-python "megatron-core==0.19.2"
extras="log"
[ "${1:-}" = "test" ] && extras="log,test"
$PIP install -e ".[${extras}]"
# megatron.core is not imported here: on a machine without CUDA it needs megatron_dapo's CPU shim.
echo "install.sh: ready ($(.venv/bin/python -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "megatron-core", m.version("megatron-core"))'))"
