"""The recipes' SLURM machinery on a real two-node SLURM (slurm-wlm 22.05, two slurmd on this machine:
tests/helpers/slurm_cluster.py), with the CPU demo's recipe (recipes/cpu-tiny/train.sbatch, 2 nodes
x 1 process, DP=2).

* A job whose time limit falls mid-run: the trainer knows the job's end (launch.sh exports it from
  scontrol), stops with a checkpoint before a step would cross it, the batch script requeues the
  job, and its second run resumes to the same records as an uninterrupted run (2 processes on one
  node: two agents and one give the same records, tests/functional/test_multinode_rehearsal.py).
  SLURM never has to kill anything (no "DUE TO TIME LIMIT").
* The warning signal (--signal=USR1@50) reaches the trainers through torchrun, which ignores it;
  they save after their step, with the uninterrupted run's records so far.
* The ranks ran one per node (ranks.json: n1, n2), the rendezvous went to the first node's
  NodeAddr (node names do not resolve here), and a failing run fails the job.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.demo import copy_demo_base
from tests.helpers.records import assert_same_record, assert_same_records, records
from tests.helpers.slurm_cluster import SlurmCluster, slurm_available

ROOT = Path(__file__).resolve().parents[2]
REASON = slurm_available()
# each test: one-minute jobs run 1-3 times with requeue holds (the first also makes the reference)
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.slurm, pytest.mark.timeout(1200),
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]
STEPS = 300  # more than a one-minute job holds: quiet, ~9 s of start-up, then ~0.16 s a step
# Dynamic sampling off: with it, a toy task the run has nearly solved makes a step draw ever more
# generation batches, and the uninterrupted reference run of the tail took longer than its timeout.
# A 20-s margin: the first run stops ~30 s into the job, ~190 steps in (2 runs; more under load).
ARGS = [f"train.total_steps={STEPS}", "eval.every=0", "eval.before_train=false", "checkpoint.save_every=25",
        "logging.tensorboard=false", "algorithm.filter_groups.enable=false", "checkpoint.time_limit_margin_s=20"]
ENV = {**{k: v for k, v in os.environ.items()
          if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR") and not k.startswith("SLURM")},
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def reference(demo_base, tmp_path_factory) -> Path:
    """The same run uninterrupted, one node with 2 processes, on the session's demo base, which every
    job copies too."""
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("slurm_ref") / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), f"logging.dir={run_dir}",
           *ARGS]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return run_dir


@pytest.fixture
def cluster(tmp_path):
    # cred_expire 10 s: a requeued job is held that long before it may start again (120 s by default);
    # then it waits for the scheduler's next periodic pass (every 60 s, backfill every 30 s, by default)
    with SlurmCluster(tmp_path / "slurm", cred_expire_s=10, kill_wait_s=10,
                      extra_conf=("SchedulerParameters=sched_interval=2,bf_interval=2",)) as c:
        yield c
    assert c.leftovers() == []


def _sbatch(c: SlurmCluster, out: Path, *args: str, time_min: int, timeout: float,
            signal_lead: int | None = None, env: dict | None = None, cwd: Path = ROOT,
            script: str = str(ROOT / "recipes" / "cpu-tiny" / "train.sbatch")) -> int:
    """recipes/cpu-tiny/train.sbatch submitted (from the repository root, as README says, unless
    ``cwd``; ``script`` as sbatch is given it); waits. ``signal_lead``: --signal=USR1@<it>, as the
    GPU recipes ask (measured here: it can come up to ~30 s earlier than asked, SLURM checks every 30 s)."""
    done = c.run("sbatch", "--parsable", "--wait", f"--time={time_min}", f"--output={out}",
                 *([f"--signal=USR1@{signal_lead}"] if signal_lead else []),
                 script, *args, check=False, timeout=timeout,
                 env={**ENV, **{k: v for k, v in c.env.items() if k != "PATH"}, "STATUS_DIR": str(out.parent),
                      **(env or {})},
                 cwd=cwd)
    return done.returncode


def _same_records(run_dir: Path, reference: Path) -> None:
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))
    assert_same_records(run_dir, reference)


@pytest.mark.extended  # a one-minute job and its requeue; SLURM's signal path stays in CI (below)
def test_a_job_at_its_time_limit_stops_requeues_and_resumes_to_the_same_records(reference, cluster, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    out = tmp_path / "job.out"
    rc = _sbatch(cluster, out, f"logging.dir={run_dir}", *ARGS, time_min=1, timeout=900)  # no warning signal
    text = out.read_text()
    assert rc == 0, text[-5000:] + cluster.logs()
    assert "DUE TO TIME LIMIT" not in text  # the trainer was gone before SLURM had to kill it
    assert "stopped by the job's time limit after step" in text and "requeueing job" in text
    assert "SIGUSR1 received" not in text
    assert "(run 1 of it)" in text, "the job ran a second time after its requeue"
    assert text.count("rendezvous at 127.0.0.1:") >= 2  # the first node's NodeAddr, not its name
    # one rank per node (which node holds rank 0 is c10d's choice, run by run)
    assert sorted(json.loads((run_dir / "ranks.json").read_text())["nodes"]) == ["n1", "n2"]
    _same_records(run_dir, reference)


def test_the_warning_signal_reaches_the_trainers_through_torchrun(reference, cluster, tmp_path):
    """--signal=USR1@50 goes to every process of the step: torchrun ignores it (launch.sh), the
    trainers finish their step, save and exit 0. Not requeued (REQUEUE=0; the resume is the test
    above's, in the extended tier): the records so far are the uninterrupted run's, and the last step
    is saved."""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    out = tmp_path / "job.out"
    rc = _sbatch(cluster, out, f"logging.dir={run_dir}", *ARGS, time_min=1, timeout=600, signal_lead=50,
                 env={"REQUEUE": "0"})
    text = out.read_text()
    assert rc == 0, text[-5000:] + cluster.logs()
    assert "SIGUSR1 received: finishing this step" in text and "stopped by SIGUSR1 after step" in text
    assert "requeueing job" not in text and "DUE TO TIME LIMIT" not in text
    got, want = records(run_dir), records(reference)
    assert 0 < len(got) < STEPS and [r["step"] for r in got] == list(range(1, len(got) + 1))
    for g, w in zip(got, want):
        assert_same_record(g, w)
    assert (run_dir / "checkpoints" / f"step_{len(got):08d}" / "checkpoint.json").is_file()


def test_a_failing_run_fails_the_job(cluster, tmp_path):
    """Submitted from recipes/ with a relative path: the spooled copy finds its checkout from the path
    SLURM keeps (the submit directory used to be taken for the root: recipe.env not found, rc 1)."""
    out = tmp_path / "job.out"
    rc = _sbatch(cluster, out, f"logging.dir={tmp_path / 'run'}", "train.total_steps=0", time_min=2, timeout=300,
                 cwd=ROOT / "recipes", script="cpu-tiny/train.sbatch")
    text = out.read_text()
    assert rc != 0, text[-3000:]
    assert "config error: train.total_steps must be >= 1, got 0" in text
    assert "requeueing" not in text
    # one task per node, torchrun found where the task runs (bash -c), with the node's CPUs unbound
    step = next(line for line in text.splitlines() if line.startswith("job step: srun "))
    assert "--ntasks-per-node=1" in step and "--cpu-bind=none" in step and "--cpus-per-task=" in step, step
    assert " bash -c " in step and "megatron_dapo.launch --nnodes 2 " in step.replace("\\", ""), step
