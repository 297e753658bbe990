"""The 32B recipe's structure at toy size in 4 processes (conf/cpu_rehearsal_32b.yaml): TP 2 x PP 2 with
sequence parallel, the distributed optimizer, full recompute, token-budget micro-batches, 4 rollout
replicas for 3 evaluation problems (one replica evaluates nothing), eval before training, generation
batches of 6 prompts over 4 replicas that dynamic sampling draws several of per step, a checkpoint,
a SIGKILL of every process mid-step, and a resume at another layout (TP 2 x DP 2).

Reference: the same 4 steps uninterrupted. Every step's record is there exactly once and equals it:
rollouts, rewards, dynamic sampling and evaluation exactly, the update to fp32 round-off, before the
kill and after the resume at the new layout alike (where the engine's token probabilities move by
round-off too, and micro-batches per rank follow the layout). Its first run found a megatron-core
bug: tests/distributed/test_upstream_tied_embedding_ckpt.py.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.records import LAYOUT_COUNTS, assert_same_record, records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
STEPS = 4
ARGS = [f"train.total_steps={STEPS}", "logging.tensorboard=false"]


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
            "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_rehearsal_32b.yaml"),
            f"logging.dir={run_dir}", *ARGS, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("rehearsal") / "reference"
    out = subprocess.run(_cmd(run_dir), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return run_dir, out.stdout + out.stderr


def test_the_structure_runs_as_the_32b_recipe_does(reference):
    run_dir, text = reference
    seats = "; ".join(f"replica {r}: rank {r}, scoring on {r}" for r in range(4))
    assert f"rollout: 4 replica(s) of rollout TP 1 (hf engine) over 4 trainer rank(s): {seats}" in text
    got = records(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in got if "eval/avg@4" in r] == [0, 2, 4]  # before training, then every 2
    assert max(r["dynamic_sampling/num_gen_batches"] for r in got[1:]) >= 2
    assert all(r["actor/num_updates"] == 4 for r in got[1:])
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / "checkpoint.json").read_text())
    assert (meta["layout"]["tp"], meta["layout"]["pp"], meta["layout"]["dp"]) == (2, 2, 1)
    assert meta["distributed_optimizer"] is True


def test_killed_mid_step_and_resumed_at_another_layout(reference, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    for name in ("toy", "toy_data", "toy_base"):  # the same task and base, without the warm-up
        shutil.copytree(ref_dir / name, run_dir / name)
    latest = run_dir / "checkpoints" / "latest"
    with open(tmp_path / "first.log", "w") as log:
        agent = subprocess.Popen(_cmd(run_dir), cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.time() + 600
        while not (latest.is_file() and latest.read_text().strip() == "step_00000002"):
            assert agent.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.05)
        # The agent, every rank and their reward workers (torchrun starts each rank in a session
        # of its own: killing the agent's process group would leave the ranks running).
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
        for p in procs:
            p.send_signal(signal.SIGKILL)
        agent.wait(timeout=60)
    psutil.wait_procs(procs, timeout=30)
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert max(r["step"] for r in records(run_dir)) in (2, 3)  # killed after step 2's checkpoint

    # Resume at TP 2 x PP 1 x DP 2 (the distributed optimizer's shards move from 1 to 2 ranks).
    out = subprocess.run(_cmd(run_dir, "parallel.pipeline_model_parallel_size=1"), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints'} at step 2" in out.stderr
    got, want = records(run_dir), records(ref_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]  # each step once: the killed step's record was dropped
    for g, w in zip(got[:3], want[:3]):
        assert_same_record(g, w)
    # After the resume at the new layout the same rollouts, rewards and evaluation; the update and
    # the engine's token probabilities to round-off; micro-batches per rank are the layout's own.
    for g, w in zip(got[3:], want[3:]):
        assert_same_record(g, w, round_off=("rollout/token_prob_mean",), ignore=LAYOUT_COUNTS)
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / "checkpoint.json").read_text())
    assert (meta["layout"]["tp"], meta["layout"]["pp"], meta["layout"]["dp"]) == (2, 1, 2)
    assert "eval/avg@4" in got[-1]
