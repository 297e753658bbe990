#!/usr/bin/env bash
# The smoke run for the day one 8-GPU node is lent (inside container/, no network there): every
# stage time-boxed, one PASS / FAIL / SKIP line each, a summary at the end; exit 1 if any failed.
#
#   bash tools/node_smoke.sh [--python PY] [--out DIR] [--budget S] [--shape 1.5B|tiny]
#                            [--only a,b] [--box stage=S ...] [--list]
#
# Stages (default time box in seconds; the boxes are also cut to what is left of --budget, 2400 s):
#   versions  120   python, torch, CUDA, NCCL, every GPU; each installed part imports (ABI); with
#                   CUDA, Transformer Engine and vLLM must be there (tools/gpu_smoke.py's check)
#   model     300   a Qwen2.5-1.5B-shaped HF dir with random bf16 weights and the toy tokenizer
#                   in OUT/model (--shape tiny: a small one, for tests); reused when already there
#   data       60   OUT/data/train.parquet (32 toy problems) and eval.parquet (3: fewer than the
#                   4 rollout replicas), DAPO schema, read back with the trainer's loader
#   dry-run   120   megatron-dapo train --dry-run --world-size 8: the layout and the memory plan
#   train     900   torchrun, 8 processes, conf/node_smoke.yaml: TE spec, TP 2 x PP 2 x DP 2 with
#                   sequence parallelism, 4 vLLM replicas of rollout TP 2, optimizer offload,
#                   an evaluation before step 1 on the 3 problems, 1 step, its checkpoint
#   resume    600   the same with train.total_steps=2: resumes from step 1's checkpoint, trains step 2
#   report     60   OUT/report.json and a table: the vLLM model runner, rollout/logprob_mismatch per
#                   step (fails above 1.05), per-phase times, device memory per phase vs the plan
# Without CUDA, or with fewer than 8 GPUs, train, resume and report skip and say why; the others
# run on the CPU too. Logs in OUT/<stage>.log, the run in OUT/run, the summary in OUT/summary.txt.
#
# What the machine must have (nothing is downloaded): the container's stack (container/: a CUDA
# torch, megatron-core, Transformer Engine, vLLM, transformers, pyarrow, ...; --python names its
# interpreter) and this repository as the working directory (it goes on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=python3
OUT=node_smoke_out
BUDGET=2400
SHAPE=1.5B
ONLY=""
GPUS=8
CONFIG=conf/node_smoke.yaml
declare -A BOX=([versions]=120 [model]=300 [data]=60 [dry-run]=120 [train]=900 [resume]=600 [report]=60)
ORDER=(versions model data dry-run train resume report)
NEEDS_GPUS=" train resume report "
CHECKS=tools/node_smoke.py

NAME=node_smoke.sh
UNIT=stage
# shellcheck source=tools/lib/smoke.sh
. tools/lib/smoke.sh
extra_arg() {
  case "$1" in
    --shape) SHAPE=${2:?--shape needs a value}; SHIFT=2 ;;
    *) return 1 ;;
  esac
}
smoke_parse "$@"
case "$SHAPE" in 1.5B | tiny) ;; *) smoke_die "--shape is 1.5B or tiny, got '$SHAPE'" ;; esac

smoke_env
# As recipes/lib/launch.sh sets them for a GPU run.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}" NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

# has_cuda, the number of GPUs, the first one's memory as CUDA reports it in GB (none: the plan's H100).
read -r has_cuda gpus gpu_gb < <("$PY" -c 'import torch
c = torch.cuda.is_available()
gb = "%.2f" % (torch.cuda.get_device_properties(0).total_memory / 1e9) if c else "-"
print(int(c), torch.cuda.device_count() if c else 0, gb)' 2>/dev/null)
[ -n "${has_cuda:-}" ] || smoke_die "'$PY' cannot import torch"
has_module() { "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)"; }
q() { printf '%q' "$1"; }
PYQ=$(q "$PY")
PLAN_GB=""  # the plan's capacity: this node's, where there is a GPU
[ "${gpu_gb:-"-"}" = "-" ] || PLAN_GB="--gpu-memory-gb $gpu_gb"

# The run's command: torchrun over this node's 8 GPUs, the smoke config, the paths under OUT.
run_cmd() {
  local steps=$1
  echo "$PYQ -m torch.distributed.run --standalone --nproc-per-node $GPUS -m megatron_dapo.cli train" \
    "--config $CONFIG model.hf_path=$(q "$OUT/model") data.train_files=$(q "$OUT/data/train.parquet")" \
    "data.val_files=$(q "$OUT/data/eval.parquet") logging.dir=$(q "$OUT/run") train.total_steps=$steps"
}

# step_cmd STAGE: the command of a stage, or a line 'SKIP: reason' / 'FAIL: reason' when it cannot run.
step_cmd() {
  case "$1" in
    versions) echo "$PYQ $CHECKS versions" ;;
    model) echo "$PYQ $CHECKS model --out $(q "$OUT/model") --shape $SHAPE" ;;
    data) echo "$PYQ $CHECKS data --out $(q "$OUT/data")" ;;
    dry-run)
      echo "$PYQ -m megatron_dapo.cli train --dry-run --world-size $GPUS $PLAN_GB --config $CONFIG" \
        "model.hf_path=$(q "$OUT/model") data.train_files=$(q "$OUT/data/train.parquet")" \
        "data.val_files=$(q "$OUT/data/eval.parquet") logging.dir=$(q "$OUT/run")" ;;
    train | resume)
      for m in transformer_engine vllm; do
        has_module "$m" || { echo "FAIL: $m is not installed (run inside container/)"; return; }
      done
      if [ "$1" = train ]; then
        # A fresh run: a checkpoint left by an earlier smoke run would be resumed.
        echo "rm -rf $(q "$OUT/run") && $(run_cmd 1) && $PYQ $CHECKS check-run --run $(q "$OUT/run")" \
          "--log $(q "$OUT/train.log") --steps 1"
      else
        echo "$(run_cmd 2) && $PYQ $CHECKS check-run --run $(q "$OUT/run") --log $(q "$OUT/resume.log")" \
          "--steps 2 --resumed-from 1"
      fi ;;
    report)
      echo "$PYQ $CHECKS report --run $(q "$OUT/run") --model $(q "$OUT/model") --log $(q "$OUT/train.log")" \
        "--log $(q "$OUT/resume.log") --out $(q "$OUT/report.json") --world-size $GPUS $PLAN_GB" ;;
  esac
}

step_skip() {
  if [[ "$NEEDS_GPUS" == *" $1 "* && "$has_cuda" != 1 ]]; then echo "no CUDA device"
  elif [[ "$NEEDS_GPUS" == *" $1 "* ]] && (( gpus < GPUS )); then echo "$gpus GPU(s) here, the stage needs $GPUS"; fi
}
# The dry run's line worth reading is its layout, not its last one.
on_pass() {
  if [ "$1" = dry-run ]; then echo "PASS $(grep -m 1 '^layout at' "$2" || echo "$3")"; else echo "PASS $3"; fi
}
smoke_run
