"""Separate placement at staleness 0: the trainers' side of the rollout protocol, and the engines' loop.

The engine ranks (rollout/worlds.py) run ``serve``: they wait for trainer rank 0's requests on the
transfer group and answer them, and never build megatron, the data or a reward pool. Trainer rank 0
sends the run's resolved config once the run is prepared (``start``, so the demo's files exist and
every engine loads the same model), then per generation batch the prompts and sampling params
(``generate``: each engine replica generates its contiguous share, seeded by the prompts' global
positions as colocated replicas are, and the replica leaders' results come back in replica order),
per weight sync the export's stream (``weights``), and ``stop`` when the run ends.

On the trainers, ``SeparatePlacement`` stands where ``RolloutPlacement`` stands colocated, with
the same methods: one logical replica spanning every trainer rank, whose leader (trainer rank 0)
receives every result and scores it; ``gather`` then hands the leader's summaries to every trainer
rank. Generation and training alternate (staleness 0): the step runs as the colocated one does,
with the engines idle while the trainers update.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.placement import gather_all, replica_layout, shard_range
from megatron_dapo.rollout.worlds import (
    WorldSplit,
    allgather_objects,
    broadcast_object,
    receive_weights,
    send_weights,
)

logger = logging.getLogger(__name__)


class Engines:
    """The remote engines, as the trainers hold them: ``shutdown`` (trainer rank 0 tells them to
    stop; once, however the run ends, also before they were started)."""

    def __init__(self, split: WorldSplit):
        self.split, self.stopped = split, False

    def shutdown(self) -> None:
        if self.split.transfer is not None and not self.stopped:
            self.stopped = True
            broadcast_object(self.split, ("stop",))


class SeparatePlacement:
    """The trainers' rollout placement when the engines hold ranks of their own (module doc)."""

    def __init__(self, engines: Engines):
        split = self.split = engines.split
        self.rank, self.world_size = split.side_rank, split.num_trainers
        self.replica, self.num_replicas, self.is_leader = 0, 1, split.side_rank == 0
        self.engine = engines  # Run.close shuts it down

    def start(self, cfg) -> None:
        """The engines build their engine from the run's resolved config (collective with them)."""
        if self.split.transfer is not None:
            broadcast_object(self.split, ("start", cfg))

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> tuple[range, list[list[Rollout]]]:
        """On the leader every prompt's rollouts (from the engine replicas); elsewhere none."""
        if not self.is_leader:
            return range(0), []
        broadcast_object(self.split, ("generate", [list(p) for p in prompt_ids], n, params))
        parts = allgather_objects(self.split, None)[1:]  # the engines', in engine rank order
        return range(len(prompt_ids)), [group for part in parts if part is not None for group in part]

    def gather(self, local: list) -> list:
        """The leader's ``local`` on every trainer rank."""
        if self.world_size == 1:
            return list(local)
        box = [list(local) if self.is_leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_all(self, item: Any) -> list:
        """Every trainer rank's ``item``, in rank order, on every trainer rank."""
        return gather_all(item, self.world_size, None)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, int]:
        """Every trainer rank runs the export; trainer rank 0 streams it to every engine rank."""
        if self.split.transfer is not None:
            broadcast_object(self.split, ("weights",))
        return send_weights(self.split, weights, bucket_bytes)

    def sleep(self) -> None:
        """Nothing to release: the engines' memory is not the trainers'."""

    def wake_up(self) -> None:
        """See sleep()."""


def serve(split: WorldSplit) -> int:
    """An engine rank's whole run: build the engine at ``start``, answer until ``stop``; returns
    the number of generation requests served. The engine's alarm-dump share differs from a colocated
    run's: one leader caps flagged rows over the whole batch (observe/observer.py), not per replica."""
    from megatron_dapo.rollout.engine import get_engine_cls

    engine, served = None, 0
    while True:
        request = broadcast_object(split)
        kind = request[0]
        if kind == "start":
            cfg = request[1]
            if cfg.num_threads:  # what prepare_run does on the trainers (engines never run it)
                torch.set_num_threads(cfg.num_threads)
            tp = cfg.rollout.tensor_parallel_size
            replica, num_replicas, leader = replica_layout(split.side_rank, split.num_engines, tp)
            engine = get_engine_cls(cfg.rollout.engine).from_config(str(cfg.model.hf_path), cfg)
            logger.info("engine rank %d: rollout replica %d of %d (%s engine)%s", split.side_rank, replica,
                        num_replicas, cfg.rollout.engine, ", answering" if leader else "")
        elif kind == "generate":
            prompt_ids, n, params = request[1:]
            share = shard_range(len(prompt_ids), replica, num_replicas)
            out = engine.generate([prompt_ids[i] for i in share], n, params, prompt_indices=list(share))
            allgather_objects(split, out if leader else None)
            served += 1
        elif kind == "weights":
            receive_weights(split, engine)
        elif kind == "stop":
            if engine is not None:
                engine.shutdown()
            return served
        else:
            raise RuntimeError(f"engine rank {split.side_rank}: unknown request {kind!r}")
