"""Separate placement at staleness 0 (rollout.placement=separate, rollout/separate.py) through the real
CLI under torchrun: 4 processes, ranks 0-1 training at DP=2 and ranks 2-3 holding the two HF engine
replicas, against the colocated demo in 2 processes (DP=2, the same two replicas). Both start from
the same warmed-up base and run 3 steps (dynamic sampling draws a second generation batch in the
first) and the final evaluation. The reference is the colocated run: every record must be the same,
value for value (timing and memory keys aside), since the replicas' shares and seeds are the same
and only where they run differs. The engines' own log lines show they served from ranks of their
own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.demo import LAUNCHER_VARS, copy_demo_base
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
RUN = ["train.total_steps=3", "eval.every=0", "eval.before_train=false", "checkpoint.save_every=0",
       "logging.tensorboard=false"]


def _torchrun(run_dir: Path, nproc: int, *overrides: str) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), f"logging.dir={run_dir}",
           *RUN, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    return records(run_dir), out.stdout + out.stderr


def _values(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k != "time" and not k.startswith(("timing_s/", "memory/", "perf/")) and "rss" not in k}


def test_separate_engines_at_staleness_0_reproduce_the_colocated_run(demo_base, tmp_path):
    colocated, _ = _torchrun(copy_demo_base(demo_base, tmp_path / "colocated"), 2)
    separate, log = _torchrun(copy_demo_base(demo_base, tmp_path / "separate"), 4, "rollout.placement=separate",
                              "rollout.num_ranks=2")
    assert [r["step"] for r in separate] == [1, 2, 3]
    assert separate[0]["dynamic_sampling/num_gen_batches"] == 2  # the resampling path ran too
    assert any(k.startswith("eval/") for k in separate[-1])
    for got, want in zip(separate, colocated, strict=True):
        assert _values(got) == _values(want), {k: (got.get(k), want.get(k)) for k in _values(want)
                                               if got.get(k) != want.get(k)}
    for engine in (0, 1):
        assert f"engine rank {engine}: rollout replica {engine} of 2 (hf engine), answering" in log
    assert "rollout: 1 replica(s) of rollout TP 1 (hf engine) over 2 trainer rank(s): replica 0: ranks 0-1, " \
           "scoring on 0" in log  # the trainers' view: the engines' replicas are theirs (above)


def test_a_setting_the_machine_cannot_run_is_one_line_before_the_split(tmp_path):
    """The settings checks run on every rank before the split starts any process group: on a GPU
    the trainer's error came after the transfer group was built, and the teardown's own broadcast
    on it hid the error (docs/gpu.md). Here: the TE spec on a CPU, 1 trainer and 1 engine rank on one
    node, both refusing it; the node's first rank says so (cli.main: once per node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
           f"logging.dir={tmp_path / 'run'}", "rollout.placement=separate", "rollout.num_ranks=1",
           "model.transformer_impl=transformer_engine"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    line = ("megatron-dapo: config error: model.transformer_impl=transformer_engine needs CUDA; use local (or auto) "
            "on CPU")
    assert log.count(line) == 1, log[-3000:]
    assert "exitcode  : 2" in log and log.count("exitcode  : ") == 2, log[-3000:]  # both ranks refused it
    # torchrun's own report of a failed child is a traceback; none runs through our code
    assert str(ROOT / "megatron_dapo") not in log and "engine rank 0" not in log, log[-3000:]
    assert not (tmp_path / "run").exists()  # nothing written
