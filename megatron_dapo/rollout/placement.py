"""Where rollouts happen: every rank holds a share of one engine replica, and every rank gets the results.

Ranks form rollout groups of ``rollout.tensor_parallel_size`` consecutive ranks, independent of
Megatron's TP/PP layout; each group is one engine replica (vLLM carves the same groups out of the
world under ``external_launcher``; the HF engine simply holds the whole model on each rank)::

    ranks     0   1 | 2   3 | 4   5 | 6   7        rollout TP = 2  ->  4 replicas
    replica     0   |   1   |   2   |   3
    prompts   [0, 2)| [2, 4)| [4, 6)| [6, 8)       a generation batch of 8 prompts, split in order
              generate on every rank of the replica; score on its leader (first rank)
    gather    the leaders' results, concatenated in replica order, on every rank

A generation batch is split into contiguous, balanced shares in prompt order; each replica passes
the prompts' global positions to the engine (``prompt_indices``), whose per-response seeds derive
from them, so the gathered result does not depend on the number of replicas. Only what callers put
in the gather travels (training sends full groups only for those dynamic sampling keeps).

Memory phases (colocated on a GPU; no-ops for the HF engine and vLLM's CPU build): ``generate``
wakes the engine (KV cache included) before generating; the loop calls ``sleep`` before the trainer's
old-log-prob pass and updates; ``sync`` streams the new weights into every replica, and the engine
wakes only its weights for that (``VLLMEngine.update_weights``), the KV cache at the next generate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.engine import GenerationAborted, Rollout, RolloutEngine, SamplingParams
from megatron_dapo.rollout.weight_sync import sync_weights

if TYPE_CHECKING:
    from megatron_dapo.rollout.gen_progress import ProgressSink

CUT_SHORT = "the generation batch was aborted (a stop cut the step short)"  # both placements' message


def replica_layout(rank: int, world_size: int, tensor_parallel_size: int) -> tuple[int, int, bool]:
    """(replica index, number of replicas, is the replica's leader) of ``rank``.

    Raises ValueError naming the sizes when rollout TP does not divide the world.
    """
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={tensor_parallel_size} does not divide the world size "
                         f"{world_size}: every rank holds part of one replica; use a divisor of {world_size}")
    return rank // tensor_parallel_size, world_size // tensor_parallel_size, rank % tensor_parallel_size == 0


def gather_all(item: Any, world_size: int, group: Any) -> list:
    """Every rank's ``item`` of ``group`` (None: the default world of ``world_size`` ranks), in rank
    order, on every rank."""
    if world_size == 1:
        return [item]
    parts: list = [None] * world_size
    dist.all_gather_object(parts, item, group=group)
    return parts


def with_version(outputs: list[list[Rollout]], version: int) -> list[list[Rollout]]:
    """``outputs`` with every rollout's ``weight_version`` set to ``version`` (in place)."""
    for group in outputs:
        for rollout in group:
            rollout.weight_version = version
    return outputs


def shard_range(num_items: int, shard: int, num_shards: int) -> range:
    """Shard ``shard`` of ``num_items`` split into ``num_shards`` contiguous, balanced ranges
    (the first ``num_items % num_shards`` shards hold one more)."""
    base, extra = divmod(num_items, num_shards)
    start = shard * base + min(shard, extra)
    return range(start, start + base + (shard < extra))


class RolloutPlacement:
    """One run's rollout replicas: splits generation, gathers results, syncs weights, sleeps/wakes.

    Args:
        engine: this rank's engine (its share of the replica: a TP shard for vLLM).
        tensor_parallel_size: ranks per replica (``rollout.tensor_parallel_size``).
        group: process group for the result gather (pickled objects); None = a gloo group over the
            whole world, created here (collective: every rank must build its placement together).
        alone: this rank's engine as the only replica, whatever the world (a one-process
            reference, or a rank evaluating by itself).
    """

    def __init__(self, engine: RolloutEngine, *, tensor_parallel_size: int = 1, group: Any = None,
                 alone: bool = False):
        self.engine = engine
        initialized = dist.is_available() and dist.is_initialized() and not alone
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.replica, self.num_replicas, self.is_leader = replica_layout(
            self.rank, self.world_size, tensor_parallel_size)
        if group is None and self.world_size > 1 and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")  # objects travel on the CPU, not through NCCL
        self._group = group
        self._asleep = False
        self.version = 0  # the trainer steps in the engine's weights (the last sync's version)
        self._requests = 0  # request ids of ``submit``
        self._submitted: dict[int, tuple[range, list[list[Rollout]]]] = {}
        self._aborted = threading.Event()  # set by ``abort`` (another thread), until ``clear_abort``

    def share(self, num_items: int) -> range:
        """Global positions of this replica's share of ``num_items`` prompts."""
        return shard_range(num_items, self.replica, self.num_replicas)

    # ------------------------------------------------------------------ phases
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> tuple[range, list[list[Rollout]]]:
        """This replica's share of a whole generation batch: (global positions, rollouts per prompt).

        Every rank calls it with the same batch and params; ranks of one replica get the same share,
        which may be empty (then the engine still takes part in the generation, returning []).
        """
        self.wake_up()
        share = self.share(len(prompt_ids))
        # Called even with an empty share (fewer prompts than replicas): vLLM's data-parallel
        # replicas step in lockstep, all-reducing "anything unfinished?" every engine step over
        # the replicas (docs/DESIGN.md "Rollout placement"); a replica that skipped the call
        # would leave the others waiting in that all-reduce for ever.
        try:
            outputs = self.engine.generate([prompt_ids[i] for i in share], n, params, prompt_indices=list(share))
        except GenerationAborted:
            if not self._aborted.is_set():
                raise
        # An abort reaches the ranks at different moments (one rank's signal, or a batch that ended
        # just before it): every rank learns whether any was aborted, and all leave together
        # before the results' gather (one small exchange per generation batch).
        aborted = self._aborted.is_set()
        if self.world_size > 1:
            aborted = any(self.gather_all(aborted))
        if aborted:
            raise GenerationAborted(CUT_SHORT)
        return share, with_version(outputs, self.version)

    # ------------------------------------------------------------------ asked for ahead
    def submit(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        """Generates the batch now and keeps this replica's share for ``collect``: the engine and the
        trainer share these ranks, so nothing can generate while the trainer trains (the config
        refuses rollout.max_staleness >= 1 colocated; the placements still answer alike)."""
        self._requests += 1
        self._submitted[self._requests] = self.generate(prompt_ids, n, params)
        return self._requests

    def collect(self, request: int) -> tuple[range, list[list[Rollout]]]:
        """What ``submit`` generated for ``request``, as ``generate`` returned it."""
        return self._submitted.pop(request)

    def wait_for(self, requests: Sequence[int], until: Callable[[], float | None] = lambda: None) -> int:
        """All of them: a submitted batch is generated before ``submit`` returns."""
        return len(requests)

    def cancel(self, requests: Sequence[int], why: str = "cancelled") -> None:
        """Forgets submitted batches nobody will collect."""
        for request in requests:
            self._submitted.pop(request, None)

    def from_leader(self, items: list) -> list:
        """The leader's ``items`` on every rank: every rank of a replica generates its requests."""
        return self.gather(items if self.is_leader else [])

    def gather(self, local: list) -> list:
        """Every replica leader's ``local`` list, concatenated in replica order, on every rank
        (what other ranks pass is ignored, so they may pass ``[]``)."""
        if self.world_size == 1:
            return list(local)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, list(local) if self.is_leader else None, group=self._group)
        return [item for part in parts if part is not None for item in part]

    def gather_all(self, item: Any) -> list:
        """Every rank's ``item``, in rank order, on every rank (small objects: names, counts)."""
        return gather_all(item, self.world_size, self._group)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             version: int | None = None) -> dict[str, int]:
        """Stream (HF name, full tensor) pairs into this rank's engine (every rank runs it, so every
        replica gets them); returns sync_weights' counts. ``version``: the trainer steps in these
        weights, stamped on the rollouts generated from them (None: unchanged)."""
        counts = sync_weights(self.engine, weights, bucket_bytes)
        if version is not None:
            self.version = version
        return counts

    def take_waits(self) -> dict[str, float]:
        """Seconds each side waited for the other since the last call: none here, the engine and
        the trainer take turns on the same ranks (SeparatePlacement measures them)."""
        return {}

    def sleep(self) -> None:
        """Release the engine's memory for the trainer (before old log-probs and updates)."""
        if not self._asleep:
            self.engine.sleep()
            self._asleep = True

    def wake_up(self) -> None:
        """Restore what sleep() released (weights if no sync did, then the KV cache)."""
        if self._asleep:
            self.engine.wake_up()
            self._asleep = False

    def shutdown(self) -> None:
        """Ends this rank's engine (its workers and, for vLLM, its groups)."""
        self.engine.shutdown()

    @property
    def aborts(self) -> bool:
        """Whether ``abort`` can end a generation: the engine can stop a batch it has begun."""
        return bool(getattr(self.engine, "aborts", False))

    def abort(self) -> bool:
        """Ends this rank's generation at the engine's next token (``Placement.abort``); False for an
        engine that cannot stop a batch it has begun."""
        if not self.aborts:
            return False
        self._aborted.set()
        self.engine.abort()
        return True

    def report_progress(self, sink: ProgressSink | None) -> None:
        """``Placement.report_progress``: an engine without ``on_progress`` reports nothing."""
        if hasattr(self.engine, "on_progress"):
            self.engine.on_progress = sink

    def arm_abort(self) -> None:
        """Nothing to arm (``Placement.arm_abort``): ``abort`` is called only while a step generates
        (train.Loop.cut_short checks under its lock), on each rank for itself."""

    def clear_abort(self) -> None:
        """The next ``generate`` runs (``Placement.clear_abort``)."""
        if self._aborted.is_set():
            self._aborted.clear()
            self.engine.clear_abort()
