"""A two-node launch rehearsed on one machine: two torchrun agents (--nnodes 2, --node-rank 0 / 1, c10d
rendezvous on 127.0.0.1), 2 processes each, 4 ranks in all, as a 16-node job starts (one agent per
node, node-local ranks 0..1, global ranks 0..3).

The CPU demo trains 2 steps at TP=2 x DP=2 and saves (every rank writes its part of the checkpoint),
then resumes at PP=2 x DP=2 and trains 2 more. Reference: the same first phase from one agent with 4
processes; splitting the ranks over two "nodes" must change nothing, so the records are equal
(exactly for rollouts, rewards and evaluation, to fp32 round-off for the update).

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29611 \\
        --rdzv-id rehearsal -m megatron_dapo.cli train --config conf/cpu_tiny.yaml parallel.tensor_model_parallel_size=2
    (the same with --node-rank 1, in a second shell)
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.records import assert_same_record, records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.extended]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
TRAIN = ["-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), "eval.every=2",
         "checkpoint.save_every=2", "logging.tensorboard=false", "toy.warmup_steps=40"]
TP2, PP2 = "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node_rank: int, nnodes: int, nproc: int, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=rehearsal", *TRAIN, *args]


def _two_nodes(run_dir: Path, *args: str) -> str:
    """Both agents at once, as two nodes would start; returns their combined output."""
    port = _port()
    logs = [open(run_dir.parent / f"{run_dir.name}.node{n}.log", "w+") for n in (0, 1)]
    procs = [subprocess.Popen(_agent(n, 2, 2, port, f"logging.dir={run_dir}", *args), cwd=ROOT, env=ENV,
                              stdout=logs[n], stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    codes = [p.wait(timeout=1200) for p in procs]
    text = []
    for f in logs:
        f.seek(0)
        text.append(f.read())
        f.close()
    assert codes == [0, 0], "\n".join(t[-4000:] for t in text)
    return "\n".join(text)


def test_two_agents_train_save_and_resume_at_another_layout(tmp_path):
    run_dir = tmp_path / "run"
    first = _two_nodes(run_dir, "train.total_steps=2", TP2)
    # every global rank came up on its node with its own rollout replica
    seats = "; ".join(f"replica {r}: rank {r}, scoring on {r}" for r in range(4))
    assert f"rollout: 4 replica(s) of rollout TP 1 (hf engine) over 4 trainer rank(s): {seats}" in first, \
        first[-3000:]
    ckpt = run_dir / "checkpoints" / "step_00000002"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["dp"] == 2, meta["layout"]
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [f"rank_{r:05d}.pt" for r in range(4)]

    # the reference: one agent, 4 processes, same layout and steps
    ref_dir = tmp_path / "one_agent"
    port = _port()
    out = subprocess.run(_agent(0, 1, 4, port, f"logging.dir={ref_dir}", "train.total_steps=2", TP2), cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    got, want = records(run_dir), records(ref_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]
    for g, w in zip(got, want):
        assert_same_record(g, w)

    second = _two_nodes(run_dir, "train.total_steps=4", PP2)
    assert "resumed from" in second and "at step 2" in second
    assert [r["step"] for r in records(run_dir)] == [0, 1, 2, 3, 4]
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / "checkpoint.json").read_text())
    assert meta["layout"]["pp"] == 2 and meta["layout"]["dp"] == 2, meta["layout"]
