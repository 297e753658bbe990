"""When a run's checkpoints are written and published: the one owner of its saves.

A due save is written after the step's updates (while the engine sleeps and the state is on the
device) and published after the step's record is logged, with the trainer state and the RNG states
as they are then (mcore/checkpoint.py). With ``checkpoint.async_save`` a child process writes the
files while the next step runs (mcore/checkpoint_background.py): the write blocks training only
while device tensors are copied to the host, and the publish comes at the first step start that
finds every rank's write finished, or before anything that needs it published (the next write, a
stop, the run's end), waiting for it there. ``saved`` is the newest step published.

A stop saves in one go (``save_now``) what is not saved yet, after publishing what is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.time_limit import StepClock
from megatron_dapo.trainer_state import TrainerState

if TYPE_CHECKING:  # the loop's modules import megatron only through the actor, at run time
    from megatron_dapo.mcore.checkpoint import PendingCheckpoint


@dataclass(frozen=True)
class _Written:
    """A checkpoint whose tensors are written (or being written) and whose publish waits."""

    pending: PendingCheckpoint
    state: dict  # the trainer state as the step ended (TrainerState.to_json())
    rng: dict  # this rank's RNG states as the step ended
    write_s: float  # seconds the write blocked training


class StepSaves:
    """A run's checkpoints, step by step (module doc).

    Args:
        actor: the run's actor (write_checkpoint / publish_checkpoint / save_checkpoint).
        ckpt_dir: the checkpoint root.
        clock: records each save's seconds (a stop's and the time limit's estimate of the next).
        background: checkpoint.async_save.
        saved: the step the newest checkpoint holds (the resume point; 0 for a fresh run).
    """

    def __init__(self, actor, ckpt_dir: str, clock: StepClock, *, background: bool, saved: int):
        self.actor, self.ckpt_dir, self.clock, self.background = actor, ckpt_dir, clock, background
        self.saved = saved
        self._written: _Written | None = None

    def write(self, steps: int) -> tuple[PendingCheckpoint, float]:
        """Writes the checkpoint after ``steps`` steps (collective) once the one before it is
        published; returns its PendingCheckpoint and the seconds the write blocked training."""
        self.flush()
        started = time.monotonic()
        pending = self.actor.write_checkpoint(self.ckpt_dir, steps, background=self.background)
        return pending, time.monotonic() - started

    def written(self, pending: PendingCheckpoint, write_s: float, state: TrainerState) -> None:
        """The step is logged: publish ``pending`` with ``state`` (and the RNG states as of now), at
        once, or when its background write is finished."""
        from megatron_dapo.mcore.checkpoint import rng_state

        self._written = _Written(pending, state.to_json(), rng_state(), write_s)
        if pending.background is None:
            self._publish()

    def poll(self) -> None:
        """A step starts: publish a background write that every rank has finished (collective)."""
        from megatron_dapo.mcore.checkpoint import write_finished

        if self._written is not None and write_finished(self._written.pending):
            self._publish()

    def flush(self) -> None:
        """Publish what is written, waiting for its background write (collective)."""
        if self._written is not None:
            self._publish()

    def save_now(self, steps: int, state: TrainerState) -> None:
        """A stop: publish what is written, then save the state after ``steps`` steps in one go
        (collective) when the newest checkpoint is older."""
        self.flush()
        if steps > self.saved:
            started = time.monotonic()
            self.actor.save_checkpoint(self.ckpt_dir, state.to_json())
            self.clock.record_save(time.monotonic() - started)
            self.saved = steps

    def _publish(self) -> None:
        """The clock records the whole save, write and publish (a background write's time in its
        child included): what a stop's one-phase save will cost."""
        written, self._written = self._written, None
        started = time.monotonic()
        self.actor.publish_checkpoint(written.pending, written.state, rng=written.rng)
        writing = written.pending.background
        in_child = (writing.write_s - writing.waited_s) if writing is not None else 0.0  # the wait overlaps it
        self.clock.record_save(written.write_s + in_child + time.monotonic() - started)
        self.saved = written.pending.step
