"""The job's time limit, and whether the next step and its checkpoint fit before it.

A 32B step takes tens of minutes, so a run that only reacts to SLURM's signals loses the step in
flight (or, when the signal comes later than a step, everything since the last checkpoint). The
trainer therefore knows the job's end time and stops on its own, with a checkpoint, before a step
would cross it (docs/DESIGN.md "Preemption and time limits").

Where the end time comes from, first found wins:
1. ``MEGATRON_DAPO_END_TIME`` (seconds since the epoch): recipes/lib/launch.sh exports it on the
   batch host from ``scontrol show job`` (SLURM 22.05 sets no ``SLURM_JOB_END_TIME``, and inside
   a container there is usually no ``scontrol``);
2. ``scontrol show job -o $SLURM_JOB_ID`` itself, when ``SLURM_JOB_ID`` is set and scontrol is on
   PATH (read by rank 0 only; the decision is shared through the stop all-reduce).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

END_TIME_ENV = "MEGATRON_DAPO_END_TIME"
STATUS_FILE_ENV = "MEGATRON_DAPO_STATUS_FILE"
_END = re.compile(r"\bEndTime=(\S+)")
RECENT_STEPS = 3  # the estimate of the next step is the slowest of the last few (their evaluation apart)


def parse_end_time(scontrol_job_line: str) -> float | None:
    """``EndTime=2026-12-01T10:05:00`` (the controller's local time, as scontrol prints it) ->
    seconds since the epoch; None for ``Unknown`` / ``None`` (no limit) or no EndTime field."""
    m = _END.search(scontrol_job_line)
    if not m:
        return None
    try:
        return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # Unknown, None: the job has no end time
        return None


def job_end_time(env: dict[str, str] | None = None, *, scontrol: bool = True) -> float | None:
    """The job's end time (seconds since the epoch), or None when there is none to respect.
    ``scontrol``: may ask SLURM (one rank does; the others learn of a stop through its all-reduce)."""
    env = os.environ if env is None else env
    value = env.get(END_TIME_ENV, "").strip()
    if value:
        try:
            end = float(value)
        except ValueError:
            raise ValueError(f"{END_TIME_ENV}={value!r} is not a number of seconds since the epoch; unset it or "
                             "give e.g. $(date -d '+2 hours' +%s)") from None
        return end if end > 0 else None
    job = env.get("SLURM_JOB_ID")
    command = shutil.which("scontrol") if scontrol else None
    if not job or command is None:
        return None
    try:
        out = subprocess.run([command, "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_end_time(out.stdout) if out.returncode == 0 else None


def write_status(state: str, detail: str, env: dict[str, str] | None = None) -> None:
    """One line, ``<state> <detail>``, into the file named by ``MEGATRON_DAPO_STATUS_FILE`` (when
    set; rank 0): "finished ..." or "stopped ...". The SLURM launcher reads its first word after the
    job step ends and requeues the job while the run is unfinished (recipes/lib/launch.sh)."""
    path = (os.environ if env is None else env).get(STATUS_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{state} {detail}\n")
    os.replace(tmp, path)


@dataclass
class StepClock:
    """Measured step, evaluation and save durations (seconds), kept in the trainer state so that a
    resumed run knows them before its first step. A step's evaluation is counted apart: it comes
    every eval.every steps, so a window of recent steps would miss it, or count it for every step."""

    steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    save: float | None = None  # the last checkpoint save
    eval: float | None = None  # the last evaluation (the one before training included)
    sync: float | None = None  # the last weight sync (not kept in the trainer state: one step measures it)
    step_started: float | None = None  # time.monotonic() at the start of the step in flight
    step_evaluates: bool = False  # the step in flight ends with an evaluation

    def start_step(self, evaluates: bool = False) -> None:
        self.step_started, self.step_evaluates = time.monotonic(), evaluates

    def end_step(self, eval_seconds: float = 0.0) -> None:
        """``eval_seconds``: the step's evaluation, recorded as such and left out of the step."""
        if self.step_started is not None:
            self.steps.append(time.monotonic() - self.step_started - eval_seconds)
        if eval_seconds:
            self.record_eval(eval_seconds)
        self.step_started, self.step_evaluates = None, False

    def record_save(self, seconds: float) -> None:
        self.save = seconds

    def record_eval(self, seconds: float) -> None:
        self.eval = seconds

    def record_sync(self, seconds: float) -> None:
        self.sync = seconds

    def save_reserve(self) -> float:
        """The time a save that must end before a kill is given: twice the last one (a save under
        load took 2-3 s more than the last one)."""
        return 2 * (self.save or 0.0)

    def rest_after_wait(self, evaluates: bool) -> float:
        """What follows a step's wait for the engines, as last measured: its sync, its evaluation
        (``evaluates``) and a save (``save_reserve``)."""
        return (self.sync or 0.0) + ((self.eval or 0.0) if evaluates else 0.0) + self.save_reserve()

    @property
    def step_estimate(self) -> float | None:
        return max(self.steps) if self.steps else None

    def seconds_to_finish(self) -> float | None:
        """The rest of the step in flight plus a save (None before any step was measured)."""
        est = self.step_estimate
        if est is None:
            return None
        if self.step_started is not None:
            est += (self.eval or 0.0) if self.step_evaluates else 0.0
            left = est - (time.monotonic() - self.step_started)
        else:
            left = 0.0
        return max(left, 0.0) + (self.save or 0.0)

    def next_step_fits(self, end_time: float, margin_s: float, now: float | None = None,
                       evaluates: bool = False) -> bool:
        """Whether one more step (``evaluates``: with its evaluation) and the save after it end
        ``margin_s`` before ``end_time`` (wall clock). What was not measured yet counts 0: before the
        first step of a fresh run only the margin counts."""
        now = time.time() if now is None else now
        step = (self.step_estimate or 0.0) + ((self.eval or 0.0) if evaluates else 0.0)
        return now + step + (self.save or 0.0) + margin_s <= end_time

    def state_dict(self) -> dict:
        return {"step_seconds": list(self.steps), "save_seconds": self.save, "eval_seconds": self.eval}

    def load_state_dict(self, state: dict) -> None:
        self.steps.extend(state.get("step_seconds", []))
        self.save = state.get("save_seconds")
        self.eval = state.get("eval_seconds")
