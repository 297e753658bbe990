# shellcheck shell=bash
# The runner both smoke scripts share (tools/gpu_smoke.sh, tools/node_smoke.sh), sourced by them:
# the common flags, time boxes cut to what is left of the budget, one PASS / FAIL / SKIP line a
# step, the summary file and the exit status.
#
# The caller sets NAME (its name in messages), UNIT (step or stage), PY, OUT, BUDGET, ONLY, the
# associative array BOX (step -> seconds) and the array ORDER, and defines
#   step_cmd STEP     the step's command, or a line 'SKIP: why' / 'FAIL: why' when it cannot run
# and may define
#   step_skip STEP    a reason to skip STEP before anything runs (nothing: run it)
#   extra_arg ARGS..  takes a flag of its own: sets SHIFT to the words it used, returns 1 if not its
#   on_pass STEP LOG LAST   'STATUS detail' for a step that exited 0 (default: PASS and LAST)

smoke_usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
smoke_die() { echo "${NAME:?}: $*" >&2; exit 2; }

# smoke_parse "$@": the common flags (and the caller's, through extra_arg), then every value checked.
smoke_parse() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --python) PY=${2:?--python needs a value}; shift 2 ;;
      --out) OUT=${2:?--out needs a value}; shift 2 ;;
      --budget) BUDGET=${2:?--budget needs a value}; shift 2 ;;
      --only) ONLY=${2:?--only needs a value}; shift 2 ;;
      --box)
        local spec=${2:?--box needs $UNIT=seconds} name
        name=${spec%%=*}
        [ -n "${BOX[$name]+x}" ] || smoke_die "--box: no $UNIT '$name' (${UNIT}s: ${ORDER[*]})"
        # shellcheck disable=SC2004 # BOX is the caller's associative array: the $ keeps the key a string
        BOX[$name]=${spec#*=}
        shift 2 ;;
      --list) printf '%s\n' "${ORDER[@]}"; exit 0 ;;
      -h | --help) smoke_usage; exit 0 ;;
      *)
        SHIFT=0
        if declare -F extra_arg > /dev/null && extra_arg "$@"; then shift "$SHIFT"
        else smoke_die "unknown argument '$1' (see --help)"; fi ;;
    esac
  done
  local n s
  for n in "$BUDGET" "${BOX[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || smoke_die "time boxes and --budget are whole seconds > 0, got '$n'"
  done
  local -a only
  IFS=, read -r -a only <<< "$ONLY"
  for s in "${only[@]}"; do
    [ -n "${BOX[$s]+x}" ] || smoke_die "--only: no $UNIT '$s' (${UNIT}s: ${ORDER[*]})"
  done
  command -v "$PY" > /dev/null || smoke_die "--python '$PY' is not a command"
}

# smoke_env: OUT made and absolute, the checkout importable, and no library reaching for the network
# (there is none on the lent machine: no hub downloads, no usage stats).
smoke_env() {
  mkdir -p "$OUT" || smoke_die "cannot make --out '$OUT'"
  OUT=$(cd "$OUT" && pwd)
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
}

# smoke_run: every step of ORDER (those of --only), each in its box; prints and writes the summary,
# then exits 1 if a step failed, else 0.
smoke_run() {
  local start width=0 failed=0 step log left box t0 cmd rc last status detail secs line reason total
  local -a summary=()
  for step in "${ORDER[@]}"; do (( ${#step} > width )) && width=${#step}; done
  start=$(date +%s)
  for step in "${ORDER[@]}"; do
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$step,"* ]]; then continue; fi
    log="$OUT/$step.log"
    left=$(( BUDGET - ($(date +%s) - start) ))
    box=${BOX[$step]}
    (( box > left )) && box=$left
    t0=$(date +%s)
    reason=""
    if declare -F step_skip > /dev/null; then reason=$(step_skip "$step"); fi
    if [ -n "$reason" ]; then
      status=SKIP detail=$reason
    elif (( left < 5 )); then
      status=SKIP detail="the --budget of ${BUDGET} s is spent"
    else
      cmd=$(step_cmd "$step")
      if [[ "$cmd" == SKIP:* || "$cmd" == FAIL:* ]]; then
        status=${cmd%%:*} detail=${cmd#*: }
      else
        echo "== $step (box ${box} s): $cmd" > "$log"
        # timeout makes its own process group and signals all of it: torchrun's workers and vLLM's
        # engine processes go too. --kill-after: a step that ignores SIGTERM still ends.
        timeout --kill-after=10 "$box" bash -c "$cmd" >> "$log" 2>&1
        rc=$?
        last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | sed 's/^[[:space:]]*//')
        case $rc in
          0) status=PASS detail=$last
             if declare -F on_pass > /dev/null; then read -r status detail < <(on_pass "$step" "$log" "$last"); fi
             [ -n "${status:-}" ] || status=PASS ;;
          3) status=SKIP detail=${last#SKIP: } ;;
          124) status=FAIL detail="timed out after ${box} s" ;;
          # SIGKILL: timeout's --kill-after once the box is over, else from outside (out of memory?)
          137) if (( $(date +%s) - t0 >= box )); then status=FAIL detail="timed out after ${box} s"
               else status=FAIL detail="killed after $(( $(date +%s) - t0 )) s (out of memory?)"; fi ;;
          *) status=FAIL detail="exit $rc: $last" ;;
        esac
      fi
    fi
    secs=$(( $(date +%s) - t0 ))
    [ "$status" = FAIL ] && failed=1
    line=$(printf "%-4s %-${width}s %4d s  %s" "$status" "$step" "$secs" "$detail")
    echo "$line"
    summary+=("$line")
  done
  total=$(( $(date +%s) - start ))
  printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
  echo "${NAME%.sh}: $(grep -c '^PASS' "$OUT/summary.txt") passed, $(grep -c '^FAIL' "$OUT/summary.txt") failed," \
    "$(grep -c '^SKIP' "$OUT/summary.txt") skipped in ${total} s; logs in $OUT/"
  exit "$failed"
}
