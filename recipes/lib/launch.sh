# shellcheck shell=bash
# Shared by every recipe script (sourced, not run). Recipes only launch: hyperparameters live in
# conf/recipes/*.yaml, and anything after the script name goes to the megatron-dapo command as
# key=value overrides. DRY_RUN=1 prints the checked layout and the exact command line(s) instead.
#
# A recipe folder's recipe.env sets RECIPE (a conf/ file), SHAPE (the Qwen2.5 size, for the layout
# check on a machine without the weights; empty for the CPU demo, whose model is made at start),
# GPUS_PER_NODE (processes per node) and, for the real recipes, DATA_DIR (default /data: what
# `megatron-dapo prepare-data --out $DATA_DIR` writes, train.parquet and eval.parquet). Its run.sh
# and train.sbatch source it and this file, then call recipe_main or slurm_nodes. PYTHON names the
# interpreter (default: python on PATH, as in the container). The launcher is torchrun's agent run
# by megatron_dapo.launch, which ends as the run ended: a stop signal that torchrun meets with
# SignalException (exit 1, a traceback) after the trainers saved gives exit 0 and one line; TORCHRUN
# names another launcher (e.g. TORCHRUN=torchrun).
#
# Under SLURM (slurm_nodes; docs/DESIGN.md "Preemption and time limits"):
#   CONTAINER_IMAGE   pyxis: run each node's torchrun in this image (.sqsh or registry URI), with
#                     CONTAINER_MOUNTS (default: the checkout, DATA_DIR and /models at the same paths)
#   RDZV_PORT         the c10d rendezvous port on the first node (default 29500)
#   REQUEUE=0         do not requeue the job when the run stopped unfinished (time limit, signal)
#   STATUS_DIR        where the trainer leaves its one-line status for the batch script (default
#                     <checkout>/runs/slurm; must be visible from the first node and the batch host)

declare -p SINGLE_NODE >/dev/null 2>&1 || SINGLE_NODE=()  # recipe.env may set it
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
if [ -n "${TORCHRUN:-}" ]; then LAUNCHER=("$TORCHRUN"); else LAUNCHER=("$PYTHON" -m megatron_dapo.launch); fi
MEGATRON_DAPO=("-m" "megatron_dapo.cli")

# The environment Megatron-Core and NCCL want; a value already set by the user or the cluster wins.
launch_env() {
  # Megatron-Core orders TP / sequence-parallel communication behind compute on one CUDA stream
  # queue; with more connections the overlap it schedules can reorder (and it warns without it).
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
  # A failed collective aborts the job instead of hanging every rank until the NCCL timeout.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  # torchrun sets 1 thread per process by default; tokenisation and the reward pool want a few.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
  export PYTHONUNBUFFERED=1
}

# check_python: PYTHON imports torch and this checkout's package (found, not imported: no start-up
# cost), or one line naming the fix; every path that runs PYTHON here calls it first.
check_python() {
  (cd "$REPO" && "$PYTHON" -c "import importlib.util as u, sys
sys.exit(0 if u.find_spec('torch') and u.find_spec('megatron_dapo') else 1)") 2>/dev/null && return 0
  echo "$0: PYTHON=$PYTHON cannot import torch and megatron_dapo: activate the environment ./install.sh made" \
       "(source $REPO/.venv/bin/activate), or set PYTHON=$REPO/.venv/bin/python" >&2
  exit 2
}

# The data files of the run: prepare-data's outputs under DATA_DIR (nothing for the CPU demo).
data_overrides() {
  [ -n "${DATA_DIR:-}" ] || return 0
  printf '%s\n' "data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/eval.parquet]"
}

# check_inputs [COMMAND]: every data file the command reads is there, before anything is launched
# (eval reads the evaluation file alone).
check_inputs() {
  [ -n "${DATA_DIR:-}" ] || return 0
  local f missing=0 files=("$DATA_DIR/train.parquet" "$DATA_DIR/eval.parquet")
  [ "${1:-}" = eval ] && files=("$DATA_DIR/eval.parquet")
  for f in "${files[@]}"; do
    if [ -f "$f" ]; then echo "input: $f ($(du -h "$f" | cut -f1))"; else echo "$0: missing input $f" >&2; missing=1; fi
  done
  if [ "$missing" = 1 ]; then
    echo "$0: write them with: megatron-dapo prepare-data --train <dapo-math-17k.parquet> --eval data/aime-2024.parquet --out $DATA_DIR (README \"At scale\"), or set DATA_DIR" >&2
    exit 2
  fi
}

# show_layout COMMAND WORLD [key=value ...]: for training, the checked layout and memory plan
# (megatron-dapo plan: non-zero when it cannot run or does not fit); otherwise the checked layout.
# Without a SHAPE (the CPU demo) only the config is checked: its model is made when the run starts.
show_layout() {
  local command=$1 world=$2; shift 2
  check_python
  if [ -z "${SHAPE:-}" ]; then
    (cd "$REPO" && "$PYTHON" "${MEGATRON_DAPO[@]}" config --config "$RECIPE" "$@" >/dev/null) || exit 2
    echo "layout at world size $world: checked when the run starts (the CPU demo makes its model then)"
    return 0
  fi
  local check=(config --world-size)
  [ "$command" = train ] && check=(plan --world-size)
  (cd "$REPO" && "$PYTHON" "${MEGATRON_DAPO[@]}" "${check[@]}" "$world" --config "$RECIPE" --shape "$SHAPE" "$@")
}

print_cmd() {
  printf '%q ' "$@"
  printf '\n'
}

# single_node COMMAND [key=value ...]: one torchrun on this node with GPUS_PER_NODE processes;
# recipe.env's SINGLE_NODE overrides (if any) first, e.g. a layout that fits one node.
single_node() {
  local command=$1; shift
  local -a data
  mapfile -t data < <(data_overrides)
  set -- "${data[@]}" "${SINGLE_NODE[@]}" "$@"
  local cmd=("${LAUNCHER[@]}" --standalone --nproc-per-node "$GPUS_PER_NODE" "${MEGATRON_DAPO[@]}" "$command"
             --config "$RECIPE" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    check_inputs "$command"
    show_layout "$command" "$GPUS_PER_NODE" "$@"
    echo "node 0 of 1 ($(hostname)):"
    print_cmd "${cmd[@]}"
    return 0
  fi
  check_inputs "$command"
  check_python
  launch_env
  cd "$REPO" && exec "${cmd[@]}"
}

# rdzv_host NODE: an address of NODE that the other nodes can reach. Node names need not resolve
# (SLURM's NodeAddr is what slurmctld itself uses); NodeAddr defaults to the name.
rdzv_host() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | sed -n 's/.*\bNodeAddr=\([^ ]*\).*/\1/p')
  echo "${addr:-$1}"
}

# job_end_time: the job's end in seconds since the epoch (0: none). SLURM 22.05 exports no
# SLURM_JOB_END_TIME; scontrol prints EndTime in local time, which date reads as such.
job_end_time() {
  local end
  end=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*\bEndTime=\([0-9T:-]*\).*/\1/p')
  if [ -n "$end" ]; then date -d "$end" +%s; else echo 0; fi
}

# container_mounts: pyxis's --container-mounts (CONTAINER_MOUNTS, else the checkout, DATA_DIR and
# /models, each at its own path).
container_mounts() {
  echo "${CONTAINER_MOUNTS:-$REPO:$REPO,${DATA_DIR:-/data}:${DATA_DIR:-/data},/models:/models}"
}

# container_flags: pyxis's options for each node's step, explicit on the srun line (a step reaches
# the image only through them; `sbatch --container-image` would put the batch script, srun
# included, into the container).
container_flags() {
  [ -n "${CONTAINER_IMAGE:-}" ] || return 0
  printf '%s\n' "--container-image=$CONTAINER_IMAGE" "--container-mounts=$(container_mounts)" \
    "--container-workdir=$REPO" --no-container-mount-home
}

# check_mounts [key=value ...]: with a container, the run's model.hf_path lies under one of its
# mounts (inside the container nothing else exists: the run would fail on every node after the
# allocation started). Read from the resolved config, so an override is checked too; a batch host
# whose PYTHON cannot read it (everything lives in the image) says so and goes on.
check_mounts() {
  [ -n "${CONTAINER_IMAGE:-}" ] || return 0
  local mounts model m dst
  mounts=$(container_mounts)
  echo "container: $CONTAINER_IMAGE, mounts $mounts"
  if ! model=$(hf_path "$@" 2>/dev/null); then
    echo "  model.hf_path not checked against them: $PYTHON cannot read the config on this host"
    return 0
  fi
  [[ $model == /* ]] || model=$REPO/$model  # the container's working directory is the checkout
  IFS=, read -ra list <<< "$mounts"
  for m in "${list[@]}"; do
    dst=${m#*:}  # SRC:DST[:FLAGS], or a path mounted at itself
    dst=${dst%%:*}
    case "$model/" in "${dst%/}/"*) return 0 ;; esac
  done
  echo "$0: model.hf_path=$model is outside the container's mounts ($mounts), so no node would find it:" \
       "move it under one (e.g. /models) or add its directory to CONTAINER_MOUNTS" >&2
  exit 2
}

# slurm_nodes COMMAND [key=value ...]: inside an sbatch allocation, one torchrun per node (srun
# --ntasks-per-node=1, each in `bash -c` so that torchrun is looked up where it runs, e.g. inside the
# container), rendezvous (c10d) at the first node of the allocation; torchrun assigns the node ranks.
# The task ignores SIGUSR1 before it execs torchrun (`--signal=USR1@...` reaches every process of the
# step, and torchrun would die of it); the trainers install their own handler. After the step, a run
# that stopped unfinished (the time limit coming, a signal) requeues the job, which resumes by itself.
# Outside SLURM, DRY_RUN=1 shows what a job of NODES nodes would run.
slurm_nodes() {
  local command=$1; shift
  local nodes head port=${RDZV_PORT:-29500} job=${SLURM_JOB_ID:-dry-run} cpus=${SLURM_CPUS_ON_NODE:-}
  local -a hosts data flags
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    head=$(rdzv_host "${hosts[0]}")
  else
    [ "${DRY_RUN:-0}" = 1 ] || { echo "$0: not inside a SLURM allocation: submit with sbatch (or DRY_RUN=1)" >&2; exit 2; }
    mapfile -t hosts < <(for i in $(seq 1 "${NODES:?set NODES for a dry run outside SLURM}"); do printf 'node%03d\n' "$i"; done)
    head=${hosts[0]}
    # shellcheck disable=SC2016  # shown unexpanded, as the job would expand it
    cpus='$SLURM_CPUS_ON_NODE'
  fi
  nodes=${#hosts[@]}
  mapfile -t data < <(data_overrides)
  mapfile -t flags < <(container_flags)
  local cmd=("${LAUNCHER[@]}" --nnodes "$nodes" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
             --rdzv-endpoint "$head:$port" --rdzv-id "$job" "${MEGATRON_DAPO[@]}" "$command" --config "$RECIPE"
             "${data[@]}" "$@")
  local task
  task="trap \"\" USR1; cd $(printf '%q' "$REPO") && exec $(print_cmd "${cmd[@]}")"
  # Every CPU of the node to the one task (8 ranks, their engines and the reward pool share them);
  # no binding, so the ranks' threads are not pinned to the cores the task happened to get first.
  local step=(srun --ntasks-per-node=1 --kill-on-bad-exit=1 ${cpus:+"--cpus-per-task=$cpus"} --cpu-bind=none
              "${flags[@]}" bash -c "$task")
  check_inputs
  check_mounts "${data[@]}" "$@"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    show_layout "$command" $((nodes * GPUS_PER_NODE)) "${data[@]}" "$@"
    echo "job step (one task per node, ${#hosts[@]} nodes: ${hosts[*]}):"
    printf '%q ' "${step[@]:0:${#step[@]}-1}"
    if [[ $task == *"'"* ]]; then printf '%q\n' "$task"; else printf "'%s'\n" "$task"; fi
    return 0
  fi
  launch_env
  mkdir -p "${STATUS_DIR:=$REPO/runs/slurm}"
  export MEGATRON_DAPO_STATUS_FILE="$STATUS_DIR/job-$SLURM_JOB_ID.status"
  rm -f "$MEGATRON_DAPO_STATUS_FILE"
  MEGATRON_DAPO_END_TIME=$(job_end_time)
  export MEGATRON_DAPO_END_TIME
  local ends=never
  [ "$MEGATRON_DAPO_END_TIME" = 0 ] || ends=$(date -d "@$MEGATRON_DAPO_END_TIME")
  echo "job $SLURM_JOB_ID (run ${SLURM_RESTART_COUNT:-0} of it): $nodes node(s), rendezvous at $head:$port, ends $ends"
  echo "job step: $(print_cmd "${step[@]}")"
  local rc=0
  (cd "$REPO" && "${step[@]}") || rc=$?
  local status=""
  [ -f "$MEGATRON_DAPO_STATUS_FILE" ] && status=$(cat "$MEGATRON_DAPO_STATUS_FILE")
  echo "job step ended: rc $rc, run ${status:-status unknown}"
  if [ "$rc" = 0 ] && [ "${status%% *}" = stopped ] && [ "${REQUEUE:-1}" = 1 ]; then
    echo "requeueing job $SLURM_JOB_ID: its next run resumes from the last checkpoint"
    scontrol requeue "$SLURM_JOB_ID"  # ends this batch shell; the job runs again, same id
  fi
  return "$rc"
}

# hf_path [key=value ...]: the run's model.hf_path (read from the resolved config, so that the path
# lives in one place and an override counts).
hf_path() {
  (cd "$REPO" && "$PYTHON" -c "import sys; from megatron_dapo.config_loading import load_config
print(load_config(sys.argv[1], sys.argv[2:]).model.hf_path)" "$RECIPE" "$@")
}

# recipe_main train|eval|convert [key=value ...]: what a recipe folder's run.sh does.
#   train    DAPO training on this node (resumes from the run's latest checkpoint)
#   eval     avg@32 on AIME 2024 ($DATA_DIR/eval.parquet) of the run's latest checkpoint
#   convert  optional: HF -> Megatron dist checkpoint (CKPT_DIR); training reads the HF weights
#            directly, each rank its own shard, so this is only for model.checkpoint= starts
recipe_main() {
  local what=${1:-}; shift || true
  case $what in
    train | eval) single_node "$what" "$@" ;;
    convert)
      check_python
      local cmd=("$PYTHON" tools/convert_ckpt/hf_to_megatron.py --hf-dir "$(hf_path)"
                 --out "${CKPT_DIR:-ckpt/$(basename "$(hf_path)")}" "$@")
      if [ "${DRY_RUN:-0}" = 1 ]; then print_cmd "${cmd[@]}"; return 0; fi
      cd "$REPO" && exec "${cmd[@]}" ;;
    *) echo "usage: $0 train|eval|convert [key=value ...]   (DRY_RUN=1: print, run nothing)" >&2; exit 2 ;;
  esac
}
