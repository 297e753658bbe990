"""Checkpoints written in the background (checkpoint.async_save=true) on the CPU job, against the
uninterrupted runs with the default one-phase saves: a background save changes when files are
written, never what a run computes or what a resume restores.

* One process: a SIGKILL as soon as a save's directory appears (its writer child may be writing),
  one at a random moment after a step, then a SIGTERM after a step; every process the trainer
  started (the writer included: it dies with the trainer) is gone after each kill, the stop exits 0
  naming its checkpoint, and the run finished by a rerun has the reference's records, bitwise.
* DP=2 under torchrun (megatron_dapo.launch, as the recipes launch it; extended tier): SIGTERM to
  the launcher after a step, then a rerun: the records equal an uninterrupted DP=2 run's with
  one-phase saves. In CI the 32B rehearsal (4 ranks, TP 2 x PP 2, background saves; killed and
  resumed at another layout) stands for it.
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.demo import copy_demo_base
from tests.helpers.demo_runs import (
    ENV, ROOT, STEPS, assert_same_as_reference, finish, kill_the_trainer, logged, read_records, record_values,
    run_train, start_train, train_cmd, wait_for, wait_for_a_save, wait_for_next_step)

pytestmark = pytest.mark.slow
ASYNC = "checkpoint.async_save=true"


def test_background_saves_survive_kills_and_a_stop_and_resume_exactly(demo_reference, tmp_path):
    run_dir = copy_demo_base(demo_reference, tmp_path / "run")
    ckpts, rng = run_dir / "checkpoints", random.Random(1)
    for attempt in range(2):
        proc = start_train(run_dir, ASYNC)
        if attempt == 0:  # a save's directory appears: its child starts writing right after
            wait_for_a_save(run_dir, proc)
        else:
            wait_for_next_step(run_dir, proc)
            time.sleep(rng.uniform(0.0, 1.0))
        kill_the_trainer(proc)  # the writer included: nothing it started is left
    proc = start_train(run_dir, ASYNC)
    wait_for_next_step(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    step = read_records(run_dir)[-1]["step"]
    assert step < STEPS, "the run finished before the signal"
    assert f"stopped by SIGTERM after step {step} of {STEPS}" in stdout
    assert (ckpts / "latest").read_text().strip() == f"step_{step:08d}"
    out = run_train(run_dir, ASYNC)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "written in the background" in out.stderr  # the saves took the background path
    assert not list(ckpts.glob("*.tmp")) and not list(ckpts.glob("*/.write_results*"))
    assert_same_as_reference(run_dir, demo_reference)


def _torchrun(run_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.launch", "--standalone", "--nproc-per-node=2"] + \
        train_cmd(run_dir, *extra)[1:]


@pytest.mark.extended
def test_background_saves_at_dp2_stop_and_resume_to_the_one_phase_runs_records(demo_base, tmp_path):
    want_dir, run_dir = (copy_demo_base(demo_base, tmp_path / name) for name in ("want", "run"))
    want = subprocess.run(_torchrun(want_dir), cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert want.returncode == 0, want.stderr[-5000:]
    with open(tmp_path / "out.txt", "w+") as out:
        agent = subprocess.Popen(_torchrun(run_dir, ASYNC), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 text=True, env=ENV)
        agent.out, agent.err = out, open(os.devnull)
        wait_for(logged(run_dir, 3), agent, "step 3")  # after the first background save
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
        out.seek(0)
        text = out.read()
    assert agent.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert read_records(run_dir)[-1]["step"] < STEPS, "the run finished before the signal"
    again = subprocess.run(_torchrun(run_dir, ASYNC), cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert again.returncode == 0, again.stderr[-5000:]
    got = read_records(run_dir)
    assert [r["step"] for r in got] == list(range(STEPS + 1)), "each step's record exactly once"
    assert record_values(got) == record_values(read_records(want_dir))
