#!/usr/bin/env bash
# One GPU smoke run for the day a single GPU is lent (no network there): every step time-boxed,
# one PASS / FAIL / SKIP line each, a summary at the end; exit 1 if any step failed.
#
#   bash tools/gpu_smoke.sh [--python PY] [--out DIR] [--budget S] [--require te,vllm]
#                           [--only a,b] [--box step=S ...] [--list]
#
# Steps (default time box in seconds; the boxes are also cut to what is left of --budget, 450 s):
#   versions   60   python, torch, CUDA, NCCL, the GPU; each installed part must import (ABI)
#   te-layer   60   a Transformer Engine LayerNormLinear, bf16, forward + backward vs fp32 torch
#   loop      150   two DAPO steps of the toy in a world of one (torchrun, NCCL, bf16): TE spec
#                   and colocated vLLM when installed, else local spec / HF engine (it says
#                   which); engine-vs-trainer log-prob mismatch < 1.05 at every step
#   sleep      90   vLLM sleep mode really releases device memory, wakes with the same weights
#   fp8-step   90   an FP8 DAPO update (TE) on odd sequence lengths; loss math stays fp32
#   gpu-tests 180   every GPU-marked test not run above, and those that run on any device
#                   (pytest -m "gpu or anydevice")
# Without CUDA every step but `versions` skips. A step whose part is absent (TE, vLLM) skips,
# unless --require names it (inside container/: --require te,vllm).
#
# What the machine must have (nothing is downloaded): a Python >= 3.11 (--python) with a CUDA
# torch, megatron-core 0.19.2, transformers, safetensors, tokenizers, pyarrow, pyyaml, psutil, tqdm,
# math-verify, pytest, pytest-timeout and hypothesis; Transformer Engine and vLLM for their steps;
# this repository as the working directory (it goes on PYTHONPATH; no install needed).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=python3
OUT=gpu_smoke_out
BUDGET=450
REQUIRE=""
ONLY=""
declare -A BOX=([versions]=60 [te-layer]=60 [loop]=150 [sleep]=90 [fp8-step]=90 [gpu-tests]=180)
ORDER=(versions te-layer loop sleep fp8-step gpu-tests)
# The pytest node ids behind the pytest steps; gpu-tests deselects them (each test runs once).
SLEEP_TEST="tests/gpu/test_vllm_engine.py::test_sleep_releases_device_memory"
FP8_TEST="tests/functional/test_loss_precision.py::test_fp8_update_on_odd_lengths"
# The checks program; a test of this runner substitutes its own (tests/unit/test_gpu_smoke.py).
CHECKS=${GPU_SMOKE_CHECKS:-tools/gpu_smoke.py}

NAME=gpu_smoke.sh
UNIT=step
# shellcheck source=tools/lib/smoke.sh
. tools/lib/smoke.sh
extra_arg() {
  case "$1" in
    --require) REQUIRE=${2:?--require needs a value}; SHIFT=2 ;;
    *) return 1 ;;
  esac
}
smoke_parse "$@"

smoke_env

has_cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null) \
  || smoke_die "'$PY' cannot import torch"
has_module() { "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)"; }
required() { [[ ",$REQUIRE," == *",$1,"* ]]; }

# absent PART MODULE: the line for a missing part, a failure when --require names it.
absent() {
  if required "$1"; then echo "FAIL: $2 is not installed, and --require names $1"; else echo "SKIP: $2 is not installed"; fi
}

# step_cmd STEP: the command of a step, or a line 'SKIP: reason' / 'FAIL: reason' when it cannot run.
step_cmd() {
  case "$1" in
    versions | te-layer) echo "$PY $CHECKS $1 --require '$REQUIRE'" ;;
    loop) echo "$PY $CHECKS loop --out '$OUT/loop' --require '$REQUIRE'" ;;
    sleep)
      if ! has_module vllm; then absent vllm vllm; return; fi
      echo "$PY -m pytest -q -p no:cacheprovider $SLEEP_TEST" ;;
    fp8-step)
      if ! has_module transformer_engine; then absent te transformer_engine; return; fi
      echo "$PY -m pytest -q -p no:cacheprovider $FP8_TEST" ;;
    gpu-tests) echo "$PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m 'gpu or anydevice' tests --deselect $SLEEP_TEST --deselect $FP8_TEST" ;;
  esac
}

step_skip() { if [ "$1" != versions ] && [ "$has_cuda" != 1 ]; then echo "no CUDA device"; fi; }
# pytest exits 0 when everything skipped: that is a skip, not a pass.
on_pass() { if [[ "$3" =~ ^[0-9]+\ skipped ]]; then echo "SKIP $3"; else echo "PASS $3"; fi; }
smoke_run
