"""Resume with algorithm.filter_groups.surplus=carry: the held prompt groups travel in the checkpoint.

With carry, kept groups beyond a step's batch are held into the next step, so a checkpoint between
two steps must hold them (trainer_state.json) and a resume must put them back in the same order.
One run stops after a step that held groups (train.total_steps reached: a deterministic stop, with
the same checkpoint a stop signal writes), is rerun with more steps, and must give every record of
one uninterrupted run bitwise (wall times aside), as tests/functional/test_faults.py compares.

Sizes: a generation batch of twice the step's prompts, so that most steps keep a surplus; the toy
base gets a short warm-up (a worse but still mixed base; max_num_gen_batches bounds a bad draw).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "conf" / "cpu_tiny.yaml"
pytestmark = pytest.mark.slow
STEPS, STOP = 4, 3
ARGS = ["logging.tensorboard=false", "logging.progress=false", "algorithm.filter_groups.surplus=carry",
        "algorithm.filter_groups.max_num_gen_batches=8", "data.prompts_per_step=8",
        "data.gen_prompts_per_batch=16", "toy.warmup_steps=40", "toy.num_train=200", "toy.num_val=16",
        # Every step evaluated: the shortened run's final evaluation is one the reference makes too.
        "eval.every=1", "eval.before_train=false", "checkpoint.save_every=0"]
# A run of its own, not one rank of a launcher's.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def _train(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIG),
           f"logging.dir={run_dir}", f"train.total_steps={steps}", *ARGS]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _values(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith("timing_s/")}
            for r in records(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("resume_carry")
    resumed, reference = tmp / "resumed", tmp / "reference"
    _train(resumed, STOP)  # makes the toy task and base too
    stopped = records(resumed)
    state = json.loads((resumed / "checkpoints" / f"step_{STOP:08d}" / "trainer_state.json").read_text())
    reference.mkdir()
    for name in ("toy", "toy_data", "toy_base"):  # the same task and base, without the warm-up
        shutil.copytree(resumed / name, reference / name)
    with ThreadPoolExecutor(2) as pool:  # independent processes: the two cores run one each
        done = [pool.submit(_train, reference, STEPS), pool.submit(_train, resumed, STEPS)]
        resume_out = done[1].result()
        done[0].result()
    return dict(stopped=stopped, state=state, resume_out=resume_out, resumed=resumed, reference=reference)


def test_the_stop_held_groups_and_the_checkpoint_holds_them(runs):
    last = runs["stopped"][-1]
    assert last["step"] == STOP
    held = last["dynamic_sampling/num_surplus_carried"]
    assert held > 0, "no surplus at the stop: the resume would not test carried groups"
    assert len(runs["state"]["held_groups"]) == held
    resumed_from = rf"resumed from {re.escape(str(runs['resumed']))}\S* at step {STOP}\b"
    assert re.search(resumed_from, runs["resume_out"].stderr)


def test_resumed_records_equal_the_uninterrupted_run(runs):
    got, want = _values(runs["resumed"]), _values(runs["reference"])
    assert sorted(got) == list(range(1, STEPS + 1)), "each step's record exactly once"
    # The first step after the resume starts from the carried groups: the same count as the reference's.
    assert got[STOP + 1]["dynamic_sampling/num_groups_carried_in"] == len(runs["state"]["held_groups"])
    assert got == want  # bitwise: floats compared with ==


def test_resumed_dumps_ledger_and_alarms_equal_the_uninterrupted_run(runs):
    """What observe/ writes resumes exactly too: the sample dumps (the stopped run's steps kept, the
    rest written again), the pass-rate ledger in the last checkpoint, the alarm log."""
    def dumps(run_dir: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((run_dir / "samples").iterdir())}

    got, want = dumps(runs["resumed"]), dumps(runs["reference"])
    assert sorted(got) == [f"step_{s:08d}.jsonl" for s in range(1, STEPS + 1)] + sorted(
        n for n in want if n.startswith("alarm_"))
    assert got == want
    state = [json.loads((d / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())
             for d in (runs["resumed"], runs["reference"])]
    assert state[0]["ledger"] == state[1]["ledger"] and state[0]["ledger"]["records"]
    assert state[0]["alarms"] == state[1]["alarms"]
    alarms = [(d / "alarms.jsonl").read_text() if (d / "alarms.jsonl").exists() else ""
              for d in (runs["resumed"], runs["reference"])]
    assert alarms[0] == alarms[1]
