"""time_limit: the job's end time from the launcher or scontrol, whether the next step fits before it,
and the status line the SLURM launcher reads."""

import os
import stat
import time

import pytest

from megatron_dapo.time_limit import (END_TIME_ENV, STATUS_FILE_ENV, StepClock, job_end_time, parse_end_time,
                                      write_status)

# One line of `scontrol show job -o 41` from slurm-wlm 22.05 (fields cut for length).
LINE = ("JobId=41 JobName=dapo UserId=root(0) JobState=RUNNING Reason=None RunTime=00:00:07 TimeLimit=00:01:00 "
        "SubmitTime=2026-12-01T10:04:00 StartTime=2026-12-01T10:04:00 EndTime=2026-12-01T10:05:00 Deadline=N/A")


def test_parse_end_time_reads_the_controllers_local_time():
    want = time.mktime((2026, 12, 1, 10, 5, 0, 0, 0, -1))
    assert parse_end_time(LINE) == want
    assert parse_end_time(LINE.replace("EndTime=2026-12-01T10:05:00", "EndTime=Unknown")) is None
    assert parse_end_time("JobId=41 JobState=PENDING") is None


def test_the_launchers_variable_wins_and_a_bad_one_is_named():
    assert job_end_time({END_TIME_ENV: "1796119500", "SLURM_JOB_ID": "41"}) == 1796119500.0
    assert job_end_time({END_TIME_ENV: "0"}) is None  # the launcher's "no limit"
    assert job_end_time({}) is None
    with pytest.raises(ValueError, match=rf"{END_TIME_ENV}='soon' is not a number"):
        job_end_time({END_TIME_ENV: "soon"})


def test_scontrol_is_asked_only_when_allowed(tmp_path):
    fake = tmp_path / "scontrol"  # stands in for SLURM's client here; the real one runs in test_slurm
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2 $3 $4\" = 'show job -o 41' ] && echo '{LINE}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"SLURM_JOB_ID": "41", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    old = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        assert job_end_time(env) == time.mktime((2026, 12, 1, 10, 5, 0, 0, 0, -1))
        assert job_end_time(env, scontrol=False) is None
    finally:
        os.environ["PATH"] = old


def test_the_next_step_fits_only_with_its_save_and_the_margin():
    clock = StepClock()
    assert clock.next_step_fits(end_time=100.0, margin_s=10.0, now=90.0)  # nothing measured: the margin
    assert not clock.next_step_fits(end_time=100.0, margin_s=10.0, now=90.1)
    clock.steps.extend([5.0, 20.0, 8.0])  # the slowest recent step (an eval step) is the estimate
    clock.record_save(7.0)
    assert clock.next_step_fits(end_time=100.0, margin_s=10.0, now=63.0)  # 63 + 20 + 7 + 10 = 100
    assert not clock.next_step_fits(end_time=100.0, margin_s=10.0, now=63.5)
    clock.steps.extend([6.0, 7.0])  # 20 s falls out of the last three
    assert clock.step_estimate == 8.0


def test_an_evaluation_counts_for_the_steps_that_evaluate():
    """eval.every steps apart, an evaluation would fall out of the recent steps' window (or count for
    every step): it is measured apart and added to the steps that end with one."""
    clock = StepClock()
    clock.start_step(evaluates=True)
    clock.step_started -= 30.0  # a step of 30 s, 25 of them its evaluation
    clock.end_step(eval_seconds=25.0)
    assert 4.9 < clock.step_estimate < 5.1 and clock.eval == 25.0
    clock.record_save(2.0)
    assert clock.next_step_fits(end_time=100.0, margin_s=0.0, now=92.0)  # 92 + 5 + 2 <= 100
    assert not clock.next_step_fits(end_time=100.0, margin_s=0.0, now=92.0, evaluates=True)  # + 25
    restored = StepClock()
    restored.load_state_dict(clock.state_dict())
    assert restored.eval == 25.0
    restored.start_step(evaluates=True)
    assert 31.9 < restored.seconds_to_finish() < 32.1  # the step, its evaluation, the save


def test_the_clock_survives_a_resume_and_estimates_the_step_in_flight():
    clock = StepClock()
    assert clock.seconds_to_finish() is None
    clock.steps.extend([4.0, 6.0])
    clock.record_save(3.0)
    restored = StepClock()
    restored.load_state_dict(clock.state_dict())
    assert (restored.step_estimate, restored.save) == (6.0, 3.0)
    assert restored.seconds_to_finish() == 3.0  # between steps no step starts after a stop: the save
    restored.step_started = time.monotonic() - 5.0
    assert 3.9 < restored.seconds_to_finish() < 4.1  # 1 s of the step left, then the save


def test_what_follows_the_wait_for_the_engines_is_the_sync_the_evaluation_and_twice_a_save():
    clock = StepClock()
    assert clock.rest_after_wait(evaluates=True) == 0.0  # nothing measured yet
    clock.record_sync(1.5)
    clock.record_eval(20.0)
    clock.record_save(4.0)
    assert clock.rest_after_wait(evaluates=False) == 1.5 + 2 * 4.0
    assert clock.rest_after_wait(evaluates=True) == 1.5 + 20.0 + 2 * 4.0
    assert "sync" not in str(clock.state_dict())  # one step measures it again after a resume


def test_write_status_is_one_line_and_only_when_asked(tmp_path):
    path = tmp_path / "status"
    write_status("stopped", "after step 3 of 10", env={})
    assert not path.exists()
    write_status("stopped", "after step 3 of 10", env={STATUS_FILE_ENV: str(path)})
    write_status("finished", "after step 10 of 10", env={STATUS_FILE_ENV: str(path)})
    assert path.read_text() == "finished after step 10 of 10\n"
