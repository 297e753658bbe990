# shellcheck shell=bash
# Shared by every recipe script (sourced, not run). Recipes only launch: hyperparameters live in
# conf/recipes/*.yaml, and anything after the script name goes to the megatron-dapo command as
# key=value overrides. DRY_RUN=1 prints the checked layout and the exact command line(s) instead.
#
# A recipe folder's recipe.env sets RECIPE (a conf/ file), SHAPE (the Qwen2.5 size, for the layout
# check on a machine without the weights) and GPUS_PER_NODE; its run.sh and train.sbatch source it
# and this file, then call recipe_main or slurm_nodes. PYTHON and TORCHRUN name the interpreter and
# launcher (default: python and torchrun on PATH, as in the container).

declare -p SINGLE_NODE >/dev/null 2>&1 || SINGLE_NODE=()  # recipe.env may set it
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}
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

# show_layout COMMAND WORLD [key=value ...]: for training, the checked layout and memory plan
# (megatron-dapo plan: non-zero when it cannot run or does not fit); otherwise the checked layout.
show_layout() {
  local command=$1 world=$2; shift 2
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
  set -- "${SINGLE_NODE[@]}" "$@"
  local cmd=("$TORCHRUN" --standalone --nproc-per-node "$GPUS_PER_NODE" "${MEGATRON_DAPO[@]}" "$command"
             --config "$RECIPE" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    show_layout "$command" "$GPUS_PER_NODE" "$@"
    echo "node 0 of 1 ($(hostname)):"
    print_cmd "${cmd[@]}"
    return 0
  fi
  launch_env
  cd "$REPO" && exec "${cmd[@]}"
}

# slurm_nodes COMMAND [key=value ...]: inside an sbatch allocation, one torchrun per node (srun
# --ntasks-per-node=1), rendezvous (c10d) at the first node of the allocation; torchrun assigns the
# node ranks. Outside SLURM, DRY_RUN=1 shows what a job of NODES nodes would run.
slurm_nodes() {
  local command=$1; shift
  local nodes head port=${RDZV_PORT:-29500} job=${SLURM_JOB_ID:-dry-run}
  local -a hosts
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else
    [ "${DRY_RUN:-0}" = 1 ] || { echo "$0: not inside a SLURM allocation: submit with sbatch (or DRY_RUN=1)" >&2; exit 2; }
    mapfile -t hosts < <(for i in $(seq 1 "${NODES:?set NODES for a dry run outside SLURM}"); do printf 'node%03d\n' "$i"; done)
  fi
  nodes=${#hosts[@]}
  head=${hosts[0]}
  local cmd=("$TORCHRUN" --nnodes "$nodes" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
             --rdzv-endpoint "$head:$port" --rdzv-id "$job" "${MEGATRON_DAPO[@]}" "$command" --config "$RECIPE" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    show_layout "$command" $((nodes * GPUS_PER_NODE)) "$@"
    local i
    for i in "${!hosts[@]}"; do
      echo "node $i of $nodes (${hosts[$i]}):"
      print_cmd "${cmd[@]}"
    done
    return 0
  fi
  launch_env
  cd "$REPO" && exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${cmd[@]}"
}

# The recipe's model.hf_path (read from the config, so that the path lives in one place).
hf_path() {
  (cd "$REPO" && "$PYTHON" -c "import sys; from megatron_dapo.config_loading import load_config
print(load_config(sys.argv[1]).model.hf_path)" "$RECIPE")
}

# recipe_main train|eval|convert [key=value ...]: what a recipe folder's run.sh does.
#   train    DAPO training on this node (resumes from the run's latest checkpoint)
#   eval     avg@32 on AIME 2024 (AIME_FILE, default /data/aime-2024.parquet) of the run's latest checkpoint
#   convert  optional: HF -> Megatron dist checkpoint (CKPT_DIR); training reads the HF weights
#            directly, each rank its own shard, so this is only for model.checkpoint= starts
recipe_main() {
  local what=${1:-}; shift || true
  case $what in
    train) single_node train "$@" ;;
    eval) single_node eval "data.val_files=[${AIME_FILE:-/data/aime-2024.parquet}]" "$@" ;;
    convert)
      local cmd=("$PYTHON" tools/convert_ckpt/hf_to_megatron.py --hf-dir "$(hf_path)"
                 --out "${CKPT_DIR:-ckpt/$(basename "$(hf_path)")}" "$@")
      if [ "${DRY_RUN:-0}" = 1 ]; then print_cmd "${cmd[@]}"; return 0; fi
      cd "$REPO" && exec "${cmd[@]}" ;;
    *) echo "usage: $0 train|eval|convert [key=value ...]   (DRY_RUN=1: print, run nothing)" >&2; exit 2 ;;
  esac
}
