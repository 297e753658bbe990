#!/usr/bin/env bash
# The smoke run for the day one 8-GPU node is lent (inside container/, no network there): every
# stage time-boxed, one PASS / FAIL / SKIP line each, a summary at the end; exit 1 if any failed.
#
#   bash tools/node_smoke.sh [--python PY] [--out DIR] [--budget S] [--shape 1.5B|tiny]
#                            [--only a,b] [--box stage=S ...] [--list]
#
# Stages (default time box in seconds; the boxes are also cut to what is left of --budget, 3300 s):
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
#   separate  900   separate placement, 12 steps at staleness 1: every step's weights sent while the
#                   engines generate the next batch, over NCCL to engines on GPUs of their own, vLLM
#                   at rollout TP 2 (8 GPUs: the trainers as in train, 4 engine GPUs; 3 to 7 GPUs: one
#                   trainer at TP 1, 2 engine GPUs); tools/hang_watch.py ends it with every rank's
#                   stacks when no step ends for 300 s (900 s before the first), then the lag and
#                   the waits are checked
# Without CUDA, or with fewer than 8 GPUs, train, resume and report skip and say why (separate
# needs 3); the others run on the CPU too. Logs in OUT/<stage>.log, the runs in OUT/run and
# OUT/separate, the summary in OUT/summary.txt.
#
# What the machine must have (nothing is downloaded): the container's stack (container/: a CUDA
# torch, megatron-core, Transformer Engine, vLLM, transformers, pyarrow, ...; --python names its
# interpreter) and this repository as the working directory (it goes on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=python3
OUT=node_smoke_out
BUDGET=3300
SHAPE=1.5B
ONLY=""
GPUS=8
CONFIG=conf/node_smoke.yaml
declare -A BOX=([versions]=120 [model]=300 [data]=60 [dry-run]=120 [train]=900 [resume]=600 [report]=60
                [separate]=900)
ORDER=(versions model data dry-run train resume report separate)
NEEDS_GPUS=" train resume report separate "
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

# The run's command: torchrun over this node's 8 GPUs (or $3 processes), the smoke config, the paths
# under OUT, the run in OUT/$2 (default run).
run_cmd() {
  local steps=$1 dir=${2:-run} nproc=${3:-$GPUS}
  echo "$PYQ -m torch.distributed.run --standalone --nproc-per-node $nproc -m megatron_dapo.cli train" \
    "--config $CONFIG model.hf_path=$(q "$OUT/model") data.train_files=$(q "$OUT/data/train.parquet")" \
    "data.val_files=$(q "$OUT/data/eval.parquet") logging.dir=$(q "$OUT/$dir") train.total_steps=$steps"
}

# The separate stage's layout: 8 GPUs, the smoke config's trainers (TP 2 x PP 2) and 2 engine
# replicas of rollout TP 2; fewer, one trainer at TP 1 and one replica (3 GPUs in all).
SEPARATE_STEPS=12
separate_cmd() {
  local nproc=8 layout="rollout.num_ranks=4"
  if (( gpus < 8 )); then
    nproc=3 layout="rollout.num_ranks=2 parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=1"
    layout+=" parallel.sequence_parallel=false"
  fi
  echo "rm -rf $(q "$OUT/separate") && $PYQ tools/hang_watch.py --run $(q "$OUT/separate") --stall 300 --first 900 --" \
    "$(run_cmd $SEPARATE_STEPS separate $nproc) rollout.placement=separate $layout rollout.max_staleness=1" \
    "checkpoint.save_every=0 eval.before_train=false actor.offload_during_rollout=false" \
    "&& $PYQ $CHECKS check-separate --run $(q "$OUT/separate") --steps $SEPARATE_STEPS"
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
    train | resume | separate)
      for m in transformer_engine vllm; do
        has_module "$m" || { echo "FAIL: $m is not installed (run inside container/)"; return; }
      done
      if [ "$1" = separate ]; then
        separate_cmd
      elif [ "$1" = train ]; then
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
  local need=$GPUS
  [ "$1" = separate ] && need=3  # a trainer and a replica of rollout TP 2
  if [[ "$NEEDS_GPUS" == *" $1 "* && "$has_cuda" != 1 ]]; then echo "no CUDA device"
  elif [[ "$NEEDS_GPUS" == *" $1 "* ]] && (( gpus < need )); then echo "$gpus GPU(s) here, the stage needs $need"; fi
}
# The dry run's line worth reading is its layout, not its last one.
on_pass() {
  if [ "$1" = dry-run ]; then echo "PASS $(grep -m 1 '^layout at' "$2" || echo "$3")"; else echo "PASS $3"; fi
}
smoke_run
