"""The one interface of a rollout placement, and the one place that picks it.

Two placements stand behind it: colocated (rollout/placement.py ``RolloutPlacement``: every rank
holds a share of an engine replica and takes turns with the trainer) and separate
(rollout/separate.py ``SeparatePlacement``: the engines hold ranks of their own and generate while
the trainers train). The loop, generation batches, scoring and evaluation see only ``Placement``;
which one runs is decided here, from whether the launch split off engine ranks (cli.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.gen_progress import ProgressSink

if TYPE_CHECKING:  # annotations only: make_placement imports a placement when it builds one, so that
    # importing the protocol (the loop, eval) loads neither placement's modules
    from megatron_dapo.rollout.placement import RolloutPlacement
    from megatron_dapo.rollout.separate import RemoteEngines, SeparatePlacement


@runtime_checkable
class Placement(Protocol):
    """What the trainer ranks use of the rollout engines.

    ``rank`` / ``world_size``: this rank among the trainer ranks that share the placement;
    ``replica`` / ``num_replicas``: this rank's engine replica (colocated; separate: one, the
    engines'); ``is_leader``: this rank scores and holds the replica's results (trainer rank 0
    with separate engines); ``aborts``: whether ``abort`` can end a generation running now.
    """

    rank: int
    world_size: int
    replica: int
    num_replicas: int
    is_leader: bool
    if TYPE_CHECKING:
        # Read-only: the loop only reads it, and the colocated placement derives it from its engine
        # (a property). At run time it stays an annotation, one of the protocol's data members.
        @property
        def aborts(self) -> bool: ...
    else:
        aborts: bool

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> tuple[range, list[list[Rollout]]]:
        """A generation batch, now: (global positions, rollouts per prompt) of this rank's part."""

    def submit(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        """A generation batch asked for ahead (rollout/pipeline.py): its request id for ``collect``."""

    def collect(self, request: int) -> tuple[range, list[list[Rollout]]]:
        """A submitted batch's rollouts, as ``generate`` returns them (waits for them)."""

    def wait_for(self, requests: Sequence[int], until: Callable[[], float | None] = lambda: None) -> int:
        """How many of the submitted ``requests``, from the first, are finished by ``until()``."""

    def cancel(self, requests: Sequence[int], why: str = "cancelled") -> None:
        """Submitted batches nobody will collect."""

    def from_leader(self, items: list) -> list:
        """A request's items that only the replica leader holds (partial rollouts' carry), as every
        rank must pass them to ``generate`` / ``submit``."""

    def gather(self, local: list) -> list:
        """Every replica leader's ``local`` list, in replica order, on every rank."""

    def gather_all(self, item: Any) -> list:
        """Every rank's ``item``, in rank order, on every rank (small objects)."""

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             version: int | None = None) -> dict[str, int]:
        """The trained weights (HF names, full tensors) into every engine; ``version``: steps trained."""

    def take_waits(self) -> dict[str, float]:
        """Seconds each side waited for the other since the last call (timing_s/*)."""

    def sleep(self) -> None:
        """The engines' memory to the trainer until the next sync (colocated)."""

    def wake_up(self) -> None:
        """What ``sleep`` released, back."""

    def shutdown(self) -> None:
        """Ends what this rank owns of the engines (at the run's end)."""

    def abort(self) -> bool:
        """Ends the generation running now (called from another thread: a stop's watchdog): its
        ``generate`` (or ``collect``) raises GenerationAborted on every trainer rank, those without
        an abort too, so that all leave together. False where it cannot (then nothing changes)."""

    def arm_abort(self) -> None:
        """A step's generation begins: from here until ``clear_abort`` a stop may cut it short
        (``abort``), and only here (the evaluation after it is never cut)."""

    def clear_abort(self) -> None:
        """Undoes an ``abort`` that came after the last ``generate`` it could end."""

    def report_progress(self, sink: ProgressSink | None) -> None:
        """This rank's engine tells ``sink`` how far its generation batches are (None: nobody)."""


def make_placement(cfg: Any, engines: RemoteEngines | None = None) -> Placement:
    """This trainer rank's placement: with ``engines`` (rollout/separate.py ``RemoteEngines``: the launch
    split off engine ranks) the separate one, its engines started with the engine's part of the run's
    resolved config ``cfg`` (rollout/engine.py ``EngineSpec``); else
    the colocated one around an engine of its own, built here from ``cfg`` (every rank at the same
    point: vLLM's external launcher forms its groups over the whole world)."""
    if engines is not None:
        from megatron_dapo.rollout.separate import SeparatePlacement

        placement = SeparatePlacement(engines)
        placement.start(cfg)
        return placement
    from megatron_dapo.rollout.engine import EngineSpec, get_engine_cls
    from megatron_dapo.rollout.placement import RolloutPlacement

    engine = get_engine_cls(cfg.rollout.engine).from_spec(EngineSpec.of(cfg))
    return RolloutPlacement(engine, tensor_parallel_size=cfg.rollout.tensor_parallel_size)


if TYPE_CHECKING:
    def _conforms(colocated: RolloutPlacement, separate: SeparatePlacement) -> tuple[Placement, Placement]:
        """Both placements are ``Placement``s, stated for the type checker (tests/unit/test_typecheck.py
        runs mypy): it names any member whose parameters, their types or defaults, or its return type
        differ from the protocol's. One assignment each, so that a mismatch names its placement and
        member. Never defined at run time."""
        as_colocated: Placement = colocated
        as_separate: Placement = separate
        return as_colocated, as_separate
