"""Generation batches asked for before their step: bounded staleness (``rollout.max_staleness``).

With separate placement the engines can generate while the trainers train. At the end of step s's
rollout (its batch full, before its old log-probs and updates) the loop asks for the first
generation batch of each step up to s + k (k = max_staleness) not yet asked for; the engines
generate them from the weights they hold then (those of step s - 1's end), while step s trains.
Step t later takes its batch instead of drawing one; any further batch dynamic sampling needs is
drawn and generated then, from the newest weights. So a trained rollout lags the trainer's weights
by at most k versions: the batch of step t, asked for in step t - k, is generated from the weights
after t - k steps and trained from those after t (docs/DESIGN.md has the timeline). Seeds are the
synchronous loop's. At k = 1 so is the order of the prompt draws (a step's first batch, then its
further ones), so only the weights differ; at k >= 2 a step's further batches are drawn after the
first batch of the step after it, and a batch drawn ahead sees the pass-rate ledger (and counts its
skipped prompts) as of the step that asked for it.

A checkpoint holds nothing in flight: no batch is asked for past a step that saves (``targets``),
so a kill resumes from a drained pipeline exactly as the uninterrupted run went on. The engines
load a step's new weights only after the batches asked for before them, so every step's sync waits
for what is in flight (train.py); at a stop that wait has a deadline (the save must end before the
kill), and a batch the engines cannot finish by then (a 32B batch takes minutes; a grace is ~30 s)
is released (``release``): aborted on the engines, saved as its prompts, seed and carried groups,
and asked for again at resume, from the checkpoint's weights (``released``). The finished ones
are collected before the stop's save (``collect_in_flight``) and kept in the trainer state
(``to_json``), so the resumed run trains on the very batches the uninterrupted one would have.
Nothing is asked for ahead when the job's end would stop the run after the next step (train.py),
so a time-limit stop has nothing to wait for; a run that ends (its last step, or its generation
budget spent) cancels what is in flight (``drop``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_dapo.rollout.engine import Rollout
from megatron_dapo.rollout.partial import Carried


@dataclass
class GenRequest:
    """One generation batch as requested: step ``step``'s (from 0) prompts, seed and carried groups;
    asked for ahead (its first batch) or drawn in its step, then in flight, collected or released."""

    step: int
    indices: list[int]  # the prompts, drawn in the synchronous loop's order
    seed: int
    request: int | None = None  # the placement's request id while in flight
    rollouts: list[list[Rollout]] | None = None  # once collected at a stop (the leader's; [] elsewhere)
    carried: list[Carried] = field(default_factory=list)  # rollout.partial: groups it continues (the leader's)

    @property
    def in_flight(self) -> bool:
        return self.rollouts is None and self.request is not None

    def to_json(self) -> dict:
        """``rollouts`` null: released at a stop, asked for again at resume."""
        rollouts = None if self.rollouts is None else [[r.to_json() for r in g] for g in self.rollouts]
        return {"step": self.step, "indices": self.indices, "seed": self.seed, "rollouts": rollouts,
                "carried": [c.to_json() for c in self.carried]}

    @classmethod
    def from_json(cls, data: dict) -> "GenRequest":
        saved = data["rollouts"]
        return cls(step=int(data["step"]), indices=list(data["indices"]), seed=int(data["seed"]),
                   rollouts=None if saved is None else [[Rollout.from_json(r) for r in group] for group in saved],
                   carried=[Carried.from_json(c) for c in data.get("carried", ())])


@dataclass
class RolloutPipeline:
    """Which steps' first batches to ask for ahead, and the batches in flight (module doc).

    Args:
        max_staleness: k (0: nothing is asked for ahead: the synchronous loop).
        total_steps: train.total_steps (no batch is asked for past the last step).
        save_every: checkpoint.save_every (0: no periodic save).
    """

    max_staleness: int
    total_steps: int
    save_every: int
    ahead: list[GenRequest] = field(default_factory=list)
    _last: int = -1  # the last step whose first batch was asked for ahead (or generated in its step)

    def targets(self, step: int, *, finished: bool) -> list[int]:
        """The steps whose first batch to ask for at the end of step ``step``'s rollout: from the
        first not yet asked for to ``step + max_staleness``, not past the last step, stopping at
        the first save (record ``r`` saves when ``r % save_every == 0``: records are steps + 1).
        ``finished``: the run ends with this step (nothing more to ask for)."""
        self._last = max(self._last, step)
        if finished:
            return []
        out = []
        for target in range(self._last + 1, min(step + self.max_staleness, self.total_steps - 1) + 1):
            if self._saves_before(step, target):
                break
            out.append(target)
        if out:
            self._last = out[-1]
        return out

    def add(self, ahead: GenRequest) -> None:
        self.ahead.append(ahead)

    def has(self, step: int) -> bool:
        """Whether step ``step``'s first batch was asked for ahead and not taken yet."""
        return bool(self.ahead) and self.ahead[0].step == step

    def take(self, step: int) -> GenRequest | None:
        """Step ``step``'s first batch when it was asked for ahead (the oldest in flight), else None."""
        if self.has(step):
            return self.ahead.pop(0)
        return None

    def in_flight(self) -> list[int]:
        """The request ids of the batches in flight, in the order asked."""
        return [a.request for a in self.ahead if a.in_flight]

    def release(self, kept: int) -> list[int]:
        """At a stop: the batches in flight after the first ``kept`` are released (asked for again at
        resume, from the checkpoint's weights); returns their request ids, for the engines to abort."""
        released = [a for a in self.ahead if a.in_flight][kept:]
        requests = [a.request for a in released]
        for ahead in released:
            ahead.request = None
        return requests

    def collect_in_flight(self, collect) -> None:
        """Before a stop's save: the rollouts of every batch still in flight, from ``collect(request)``
        (a placement's, in the order asked). Batches restored from a checkpoint hold theirs already."""
        for ahead in self.ahead:
            if ahead.in_flight:
                ahead.rollouts = collect(ahead.request)

    def released(self, step: int | None = None) -> list[GenRequest]:
        """Batches released at a stop and restored: neither in flight nor collected; with ``step``,
        those that may be asked for again at its end (no save before theirs: a resume may save more
        often than the run that released them). The others are generated in their own step."""
        return [a for a in self.ahead if a.rollouts is None and a.request is None
                and (step is None or not self._saves_before(step, a.step))]

    def _saves_before(self, step: int, target: int) -> bool:
        """Whether a periodic save falls between the end of ``step`` and step ``target``: one at the
        end of step r - 1 (record r, r % save_every == 0) must find nothing in flight."""
        return any(self.save_every and r % self.save_every == 0 for r in range(step + 1, target + 1))

    def drop(self, cancel: Callable[[list[int]], None]) -> None:
        """The run ends: what is in flight will never be trained on. ``cancel(requests)`` (a
        placement's) tells the engines, which abort those batches and serve on: the final evaluation
        need not wait behind them."""
        in_flight = [a.request for a in self.ahead if a.in_flight]
        if in_flight:
            cancel(in_flight)
        self.ahead.clear()

    def restore(self, saved: list[dict]) -> None:
        """On resume: the batches a stop collected or released (``to_json``), in step order."""
        self.ahead = [GenRequest.from_json(a) for a in saved]
        if self.ahead:
            self._last = self.ahead[-1].step

    def to_json(self) -> list[dict]:
        """The batches in flight, collected or released (a stop's save); [] at a periodic save (none
        in flight)."""
        missing = [a.step for a in self.ahead if a.in_flight]
        if missing:
            raise RuntimeError(f"batches of steps {missing} are still in flight: collect them before saving")
        return [a.to_json() for a in self.ahead]
