"""Fault injection on the CPU job: kills at random moments and mid-save, SIGTERM / SIGUSR1 /
SIGINT mid-step, two trainers on one directory, a damaged checkpoint, a finished run rerun.

Every run is checked against one uninterrupted reference run of the same command
(tests/helpers/demo_runs.py). Processes are checked with psutil: everything the trainer started
must be gone after it is killed.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.demo import copy_demo_base
from tests.helpers.demo_runs import (
    ENV, ROOT, STEPS, assert_same_as_reference, finish, kill_the_trainer, logged, read_records, record_values,
    run_train, saving, start_train, train_cmd, wait_for, wait_for_a_save, wait_for_next_step)

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(demo_reference) -> Path:
    return demo_reference


def test_kills_at_random_moments_leave_no_process_and_resume_exactly(reference, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    rng = random.Random(0)
    kills = []
    for attempt in range(3):
        proc = start_train(run_dir)
        if attempt == 0:  # mid-save: as soon as a save's temporary directory appears
            wait_for_a_save(run_dir, proc)
        else:  # a random moment after this attempt's first step
            wait_for_next_step(run_dir, proc)
            time.sleep(rng.uniform(0.0, 1.0))
        kills.append((kill_the_trainer(proc), saving(run_dir)))
    out = run_train(run_dir)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "which is no longer running" in out.stderr  # the dead trainer's lock file, taken over
    assert any(n > 0 for n, _ in kills), "the trainer had children to check"
    assert_same_as_reference(run_dir, reference)


def test_signals_stop_after_the_step_with_a_checkpoint_and_resume_exactly(reference, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        proc = start_train(run_dir)
        wait_for_next_step(run_dir, proc)
        proc.send_signal(sig)
        stdout, stderr = finish(proc)
        assert proc.returncode == 0, stderr[-3000:]
        step = read_records(run_dir)[-1]["step"]
        assert step < STEPS, "the run finished before the signal"
        latest = run_dir / "checkpoints" / f"step_{step:08d}"
        assert f"stopped by {sig.name} after step {step} of {STEPS}" in stdout and str(latest) in stdout
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == latest.name
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    out = run_train(run_dir)
    assert out.returncode == 0, out.stderr[-5000:]
    assert_same_as_reference(run_dir, reference)


def test_a_second_trainer_on_the_same_directory_is_refused(reference, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    first = start_train(run_dir)
    wait_for(logged(run_dir, 1), first, "the first trainer's first step")
    os.kill(first.pid, signal.SIGSTOP)  # mid-run for as long as the second one needs, on any machine
    try:
        second = run_train(run_dir)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2
    assert f"is in use by another trainer (pid {first.pid} on host" in second.stderr.strip().splitlines()[-1]
    _, stderr = finish(first)
    assert first.returncode == 0, stderr[-3000:]
    assert_same_as_reference(run_dir, reference)


def test_eval_reads_a_run_whose_trainer_holds_the_lock(reference):
    from megatron_dapo.run_lock import RunDirLock

    cmd = train_cmd(reference)
    cmd[cmd.index("train")] = "eval"
    with RunDirLock(reference):  # as a live trainer holds it
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((reference / "eval.json").read_text())["step"] == STEPS


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    latest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    victim = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:100])  # truncated, as by a full disk
    out = run_train(run_dir, f"train.total_steps={STEPS}")
    assert out.returncode == 0, out.stderr[-5000:]
    assert f"checkpoint {latest} is damaged ({victim.name} has 100 bytes" in out.stderr
    assert f"resumed from {run_dir / 'checkpoints'} at step {STEPS - 2}" in out.stderr
    assert_same_as_reference(run_dir, reference)


def test_a_checkpoint_of_another_shape_is_refused_before_building(reference, tmp_path):
    from megatron_dapo.config import ToyConfig
    from megatron_dapo.toy.base import make_toy_base

    hf = make_toy_base(tmp_path / "hf", seed=0, cfg=ToyConfig(hidden_size=32, intermediate_size=64, warmup_steps=1))
    out = run_train(tmp_path / "run", "toy.enable=false", f"model.hf_path={hf}",
               f"data.train_files=[{reference / 'toy_data' / 'train.parquet'}]",
               f"data.val_files=[{reference / 'toy_data' / 'val.parquet'}]",
               f"checkpoint.dir={reference / 'checkpoints'}")
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "holds another model shape (hidden_size 64 -> 32, ffn_hidden_size 192 -> 64, kv_channels 16 -> 8;" in line
    assert not (tmp_path / "run").exists()


def test_rerunning_a_finished_run_says_so(reference):
    before = (reference / "metrics.jsonl").read_bytes()
    out = run_train(reference)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"nothing to do: {reference} is already at step {STEPS} of train.total_steps={STEPS}" in out.stdout
    assert "eval/avg@4=" in out.stdout and "final evaluation" not in out.stdout
    assert "rollout replica" not in out.stderr and "resumed from" not in out.stderr  # nothing was built
    assert (reference / "metrics.jsonl").read_bytes() == before


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(reference, tmp_path):
    """torchrun, 2 ranks (DP=2): SIGTERM to rank 1 alone; rank 0 learns of it through the per-step
    all-reduce, both save the same step, every process exits 0; the rerun completes the run."""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = launcher + train_cmd(run_dir)[1:]
    with open(tmp_path / "out.txt", "w+") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV)
        agent.out, agent.err = out, open(os.devnull)
        wait_for(logged(run_dir, 1), agent, "a step")
        rank1 = [p for p in psutil.Process(agent.pid).children() if p.environ().get("RANK") == "1"]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGTERM)
        agent.wait(timeout=600)
        out.seek(0)
        text = out.read()
    assert agent.returncode == 0, text[-3000:]
    step = read_records(run_dir)[-1]["step"]
    assert step < STEPS and f"stopped by SIGTERM after step {step} of {STEPS}" in text
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    assert sorted(p.name for p in (saved / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [r["step"] for r in read_records(run_dir)] == list(range(STEPS + 1))


def test_a_generation_budget_ends_the_run_like_its_last_step(reference, tmp_path):
    """train.generation_budget: the run stops after the step that spends it, evaluates and saves
    there as at train.total_steps, trains exactly as the unbudgeted run up to that step, and a
    rerun has nothing to do."""
    ref = {r["step"]: r for r in read_records(reference)}
    totals = [ref[s]["rollout/responses_generated_total"] for s in range(1, STEPS + 1)]
    counted = [sum(ref[s]["dynamic_sampling/num_groups_generated"] * 8 for s in range(1, t + 1))
               for t in range(1, STEPS + 1)]
    assert totals == counted  # every generation batch counted, kept or dropped
    budget = int(totals[2]) - 1  # spent during step 3
    run_dir = copy_demo_base(reference, tmp_path / "run")
    out = run_train(run_dir, f"train.generation_budget={budget}")
    assert out.returncode == 0, out.stderr[-3000:]
    got = read_records(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert "eval/avg@4" in got[-1] and "final evaluation: eval/" in out.stdout
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()
    same = lambda r: {k: v for k, v in record_values([r])[r["step"]].items() if not k.startswith("eval/")}  # noqa: E731
    assert [same(r) for r in got] == [same(ref[r["step"]]) for r in got]
    again = run_train(run_dir, f"train.generation_budget={budget}")
    assert again.returncode == 0 and "nothing to do" in again.stdout and f"generation_budget={budget}" in again.stdout


def test_a_step_that_cannot_finish_within_the_grace_is_abandoned_with_exit_0(reference, tmp_path):
    """checkpoint.stop_grace_s=0: no step fits, so the step in flight is abandoned at the signal
    (what a 20-minute step under torchrun's 30 s or SLURM's KillWait gets); the saved steps stay,
    the rerun redoes the rest and ends equal to the uninterrupted run."""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    proc = start_train(run_dir, "checkpoint.stop_grace_s=0")
    wait_for(logged(run_dir, 3), proc, "step 3")  # a checkpoint at step 2 exists
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - sent < 10
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert f"abandoning the step; the last checkpoint is {latest}, rerun the same command" in stderr
    assert "Traceback" not in stderr
    out = run_train(run_dir)
    assert out.returncode == 0, out.stderr[-5000:]
    assert_same_as_reference(run_dir, reference)


def test_the_jobs_end_stops_the_run_before_it_with_a_checkpoint(reference, tmp_path):
    """MEGATRON_DAPO_END_TIME (what recipes/lib/launch.sh exports from SLURM): the run stops when the
    next step and its save would end past it, saves, exits 0; the rerun completes it exactly."""
    # The promise holds once the clock has measured a step and a save (time_limit.StepClock: before
    # that only the margin counts), i.e. for a stop after step 3 or later (saves every 2 steps). Start-up
    # takes ~5 s here and 10 steps 2-3 s, both with the load: the job's end is moved a second at a time
    # until the run stops inside that window (earlier when it finished first, later when it stopped
    # before step 3).
    offset = 7
    for attempt in range(8):
        run_dir = copy_demo_base(reference, tmp_path / f"run{attempt}")
        end = int(time.time() + offset)  # whole seconds, as SLURM gives it: the run's end is exactly this one
        out = subprocess.run(train_cmd(run_dir, "checkpoint.time_limit_margin_s=0"), cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env={**ENV, "MEGATRON_DAPO_END_TIME": str(end)})
        assert out.returncode == 0, out.stderr[-3000:]
        step = read_records(run_dir)[-1]["step"] if read_records(run_dir) else 0
        if 3 <= step < STEPS:
            break
        offset += -1 if step >= STEPS else 1 if step else 3  # no step at all: start-up took the whole window
    assert 3 <= step < STEPS and f"stopped by the job's time limit after step {step} of {STEPS}" in out.stdout, \
        (step, offset)
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert (ckpt / "checkpoint.json").stat().st_mtime <= end  # the step and its save ended before the end
    out = run_train(run_dir)
    assert out.returncode == 0, out.stderr[-5000:]
    assert_same_as_reference(run_dir, reference)


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_and_left_as_it_is(reference, tmp_path):
    run_dir = copy_demo_base(reference, tmp_path / "run")
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    victims = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        victim = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:100])  # truncated, as by a full disk
        victims.append((ckpt.name, victim.name))
    assert len(victims) == 2
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    out = run_train(run_dir, f"train.total_steps={STEPS + 2}")
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"megatron-dapo: error: {run_dir / 'checkpoints'}: no intact checkpoint to resume from (")
    for name, file in victims:
        assert f"{name}: {file} has 100 bytes, the save wrote" in line
    assert "checkpoint.resume=never" in line and "nothing was changed" in line
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_the_run_records_the_config_it_ran(reference):
    """The demo's config as setup resolved it (its data files and base in the run directory), not
    the caller's (data/aime-2024.parquet and an empty model.hf_path): config.yaml and W&B get it."""
    from megatron_dapo.config_loading import load_config

    cfg = load_config(reference / "config.yaml")
    assert cfg.model.hf_path == str(reference / "toy_base")
    assert cfg.data.train_files == (str(reference / "toy_data" / "train.parquet"),)
    assert cfg.data.val_files == (str(reference / "toy_data" / "val.parquet"),)


def _stalled(run_dir: Path, log: Path, *, nproc: int = 1, grace_s: int = 8) -> subprocess.Popen:
    """The demo with the stalling HF engine (tests/helpers/stalling_engine.py): its 6th generation,
    step 4's batch (the evaluation before training is the 1st, step 1 draws two batches), waits for
    an abort; ``nproc`` processes, under torchrun when 2 (DP=2)."""
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                                   if nproc > 1 else [])
    cmd = launcher + ["-m", "tests.helpers.stalling_engine"] + train_cmd(run_dir, "rollout.engine=stalling_hf",
                                                                     f"checkpoint.stop_grace_s={grace_s}")[3:]
    out = open(log, "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**ENV, "STALL_CALL": "6"})
    proc.out, proc.err = out, open(os.devnull)
    return proc


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_stop_during_generation_cuts_the_step_and_saves_the_steps_before_it(reference, tmp_path, nproc):
    """SIGTERM to every trainer process (as SLURM's scancel and time limit send it) while step 4
    generates, its batch outlasting the grace: the step's generation is aborted and steps 3 and before
    saved as they were at step 4's start, exit 0; the rerun redoes step 4 on and ends equal to the
    uninterrupted run. Before, the watchdog abandoned the step at the grace's end and the resume went
    back to the periodic checkpoint of step 2."""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    log = tmp_path / "stalled.log"
    proc = _stalled(run_dir, log, nproc=nproc)
    wait_for(lambda: log.read_text().count("call 6 stalls") == nproc, proc, "step 4's stalled batch")
    assert read_records(run_dir)[-1]["step"] == 3
    workers = psutil.Process(proc.pid).children() if nproc > 1 else [proc]
    assert len(workers) == nproc
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    finish(proc)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("call 6 stall ended by an abort") == nproc, text[-3000:]
    assert "megatron-dapo: SIGTERM: step 4 cut short in its generation; saving steps 3-3" in text
    latest = run_dir / "checkpoints" / "step_00000003"
    assert f"stopped by SIGTERM after step 3 of {STEPS}, step 4 cut short in its generation" in text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == latest.name and str(latest) in text
    assert "abandoning" not in text and "Traceback" not in text  # cut and saved within the 8 s grace
    assert [r["step"] for r in read_records(run_dir)] == [0, 1, 2, 3]
    out = run_train(run_dir) if nproc == 1 else subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] + train_cmd(run_dir)[1:],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-5000:]
    if nproc == 1:
        assert_same_as_reference(run_dir, reference)
    else:  # DP=2 runs its own numbers (gradients reduced over two ranks): each step once
        assert [r["step"] for r in read_records(run_dir)] == list(range(STEPS + 1))


@pytest.mark.parametrize("launcher", ["megatron_dapo.launch",  # plain torchrun: what the launcher changes
                                      pytest.param("torch.distributed.run", marks=pytest.mark.extended)])
def test_a_stop_signal_to_the_launcher_ends_it_as_the_run_ended(reference, tmp_path, launcher):
    """SIGTERM to the agent (DP=2): it forwards SIGTERM, both trainers save and exit 0. Plain torchrun
    then raises SignalException (rc 1, a traceback); megatron_dapo.launch, the same agent, exits 0
    with one line naming the run's checkpoint, as the recipes launch it."""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2"] + train_cmd(run_dir)[1:]
    with open(tmp_path / "out.txt", "w+") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV)
        agent.out, agent.err = out, open(os.devnull)
        wait_for(logged(run_dir, 1), agent, "a step")
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
        out.seek(0)
        text = out.read()
    step = read_records(run_dir)[-1]["step"]
    saved = f"stopped after step {step} of {STEPS}, by SIGTERM; checkpoint {run_dir / 'checkpoints'}"
    if launcher == "torch.distributed.run":
        assert agent.returncode == 1 and "SignalException" in text and "Traceback" in text
        return
    assert agent.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith(f"megatron-dapo: SIGTERM reached the launcher; the run {saved}")
