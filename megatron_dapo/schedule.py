"""When things happen in a run: the one owner of a step's timing.

The loop asks, and this object answers from the config, the stop request and the measured clock:
whether the run stops before a step (a signal every rank agreed on, or the job's end: the step and
its save would not fit, time_limit.py), whether a step evaluates (eval.every, the last step) or
saves (checkpoint.save_every, the run's end), whether the run is finished (train.total_steps, the
generation budget), how long a stop's wait for the engines may last, and whether to ask for
nothing ahead (the job's end is near). It starts and ends each step on the clock and the profiler.
"""

from __future__ import annotations

import time

from megatron_dapo.config import DAPOConfig, EvalConfig, TrainConfig
from megatron_dapo.observe.profiler import StepProfiler
from megatron_dapo.preemption import ABANDON_SAFETY_S, TIME_LIMIT, StopRequest
from megatron_dapo.time_limit import StepClock


def finished(train: TrainConfig, steps: int, generated: int) -> bool:
    """Nothing left to do after ``steps`` steps and ``generated`` responses: train.total_steps
    reached, or the generation budget spent."""
    return steps >= train.total_steps or 0 < train.generation_budget <= generated


def evaluates(eval: EvalConfig, train: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (from 1) ends with an evaluation (eval.every, and the last step; a
    generation budget's last step is known only once it ran)."""
    return bool(eval.every and step % eval.every == 0) or step == train.total_steps


def job_ends_after_next(cfg: DAPOConfig, clock: StepClock, end_time: float | None, step: int,
                        step_evaluates: bool) -> bool:
    """Whether the job's end will stop the run after step ``step + 1`` (the one after this): this
    step's rest (at most a step, and its evaluation: ``step_evaluates``) and the next one with its
    save would not fit. Then nothing is asked for ahead, and the time-limit stop has nothing in
    flight to wait for."""
    if end_time is None:
        return False
    this_ends = time.time() + (clock.step_estimate or 0.0) + ((clock.eval or 0.0) if step_evaluates else 0.0)
    return not clock.next_step_fits(end_time, cfg.checkpoint.time_limit_margin_s, now=this_ends,
                                    evaluates=evaluates(cfg.eval, cfg.train, step + 2))


class StepSchedule:
    """A run's "when" (module doc).

    Args:
        cfg: the run's config (train.total_steps and generation_budget, eval.every, checkpoint).
        stop: the run's stop request (signals; the time limit is requested through it).
        clock: measured step, evaluation, save and sync seconds (restored from the checkpoint).
        end_time: the job's end (seconds since the epoch; rank 0's, None elsewhere and without one).
        profiler: the profile.steps switch, told where each step begins and ends.
    """

    def __init__(self, cfg: DAPOConfig, stop: StopRequest, clock: StepClock, end_time: float | None,
                 profiler: StepProfiler):
        self.cfg, self.stop, self.clock, self.end_time, self.profiler = cfg, stop, clock, end_time, profiler
        self.step_evaluates = False  # the step in flight ends with an evaluation (eval.every, the last step)

    def begin(self, step: int) -> bool:
        """Whether step ``step`` (from 0) runs: False when the run stops before it, every rank alike
        (a signal, or the job's end: the step with its evaluation and save would end past it)."""
        self.step_evaluates = evaluates(self.cfg.eval, self.cfg.train, step + 1)
        if self.end_time is not None and not self.clock.next_step_fits(
                self.end_time, self.cfg.checkpoint.time_limit_margin_s, evaluates=self.step_evaluates):
            self.stop.request(TIME_LIMIT)
        if self.stop.agreed():  # every rank stops after the same step
            return False
        self.clock.start_step(self.step_evaluates)
        self.profiler.begin_step(step + 1)
        return True

    def finished(self, steps: int, generated: int) -> bool:
        return finished(self.cfg.train, steps, generated)

    def saves(self, steps: int, run_finished: bool) -> bool:
        """Whether the step that makes ``steps`` saves (checkpoint.save_every, or the run's end)."""
        every = self.cfg.checkpoint.save_every
        return bool(every and steps % every == 0) or run_finished

    def job_ends_after_next(self, step: int) -> bool:
        """Rank 0's answer (only it may know the job's end; the caller shares it): module function."""
        return job_ends_after_next(self.cfg, self.clock, self.end_time, step, self.step_evaluates)

    def wait_reserve_s(self) -> float:
        """How long before a stop's kill its wait for the engines must end: the rest of the step (its
        sync, evaluation, save) and the watchdog's safety margin twice."""
        return self.clock.rest_after_wait(self.step_evaluates) + 2 * ABANDON_SAFETY_S

    def end(self, steps: int, eval_seconds: float) -> None:
        """The step that makes ``steps`` is done; ``eval_seconds``: its evaluation's, apart."""
        self.profiler.end_step(steps)
        self.clock.end_step(eval_seconds=eval_seconds)
