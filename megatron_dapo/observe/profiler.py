"""A torch profiler trace of chosen training steps (``profile.steps``), and named phase ranges.

Tracing a whole run would cost time and gigabytes, so the trace covers only steps a..b (1-based,
inclusive: step N is the loop's N-th step), and is written per rank to
``<run_dir>/profile/rank{R}_steps{a}-{b}.json``, a chrome trace that chrome://tracing and
https://ui.perfetto.dev open. Each traced step is a ``step_N`` range in it.

``phase_range(name)`` (defined in metrics_log.py, re-exported here) marks a phase of the step
(rollout, train, ...) both for the torch profiler (``record_function``) and, on CUDA, for Nsight
Systems (an NVTX range), so both tools show the same phases; MetricsLogger.timer opens one per
timer, so the timed phases are the traced ones.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# Defined next to its user, MetricsLogger.timer: metrics_log importing observe would be an import
# cycle (observe imports metrics_log; tests/unit/test_boundaries.py). Re-exported for the loop.
from megatron_dapo.metrics_log import phase_range

__all__ = ["PROFILE_DIR", "StepProfiler", "phase_range"]

if TYPE_CHECKING:
    from megatron_dapo.config import ProfileConfig

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"


class StepProfiler:
    """Starts ``torch.profiler.profile`` at step a and exports its trace after step b.

    Call ``begin_step(n)`` / ``end_step(n)`` around step n (or use ``with prof.step(n):``), and
    ``close()`` when the loop ends, however it ends: a loop that stops inside a..b (time limit,
    preemption, an error) then still writes what was recorded. A run resumed inside a..b starts
    the trace at its first step. With ``profile.steps`` empty every call returns at once.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, rank: int):
        self.enabled = bool(cfg.steps)
        self.first, self.last = cfg.steps if self.enabled else (0, 0)
        self.with_stack = cfg.with_stack
        self.path = Path(run_dir) / PROFILE_DIR / f"rank{rank}_steps{self.first}-{self.last}.json"
        self._profile: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._traced: list[int] = []  # the steps recorded so far
        self._done = False  # exported (or closed): never starts again

    def begin_step(self, step_number: int) -> None:
        """Before step ``step_number`` (1-based): starts the trace at the first step in a..b."""
        if not self.enabled or self._done or not self.first <= step_number <= self.last:
            return
        if self._profile is None:
            self._profile = torch.profiler.profile(activities=_activities(), with_stack=self.with_stack)
            self._profile.start()
        self._close_step_range()  # a step begun without end_step (not expected) ends here
        self._step_range = torch.profiler.record_function(f"step_{step_number}")
        self._step_range.__enter__()
        self._traced.append(step_number)

    def end_step(self, step_number: int) -> None:
        """After step ``step_number``: closes its range; after step b, exports the trace."""
        if self._profile is None:
            return
        self._close_step_range()
        if step_number >= self.last:
            self._export()

    @contextlib.contextmanager
    def step(self, step_number: int) -> Iterator[None]:
        """begin_step / end_step around the block; an error in it exports the partial trace."""
        self.begin_step(step_number)
        try:
            yield
        except BaseException:
            self.close()
            raise
        self.end_step(step_number)

    def close(self) -> None:
        """Exports the trace if one is running (the loop stopped before step b); idempotent."""
        if self._profile is not None:
            self._close_step_range()
            self._export()
        self._done = True

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _export(self) -> None:
        """Stops the profiler and writes the trace; one log line says where and how to open it."""
        profile, self._profile, self._done = self._profile, None, True
        profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.path))
        traced = f"{self._traced[0]}..{self._traced[-1]}" if self._traced else "none"
        logger.info("Profiler trace of steps %s (asked: %d..%d) written to %s; open it in "
                    "https://ui.perfetto.dev or chrome://tracing", traced, self.first, self.last, self.path)


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
