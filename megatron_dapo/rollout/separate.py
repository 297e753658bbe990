"""Separate placement: the trainers' side of the rollout protocol, and the engines' loop.

The engine ranks (rollout/worlds.py) run ``serve``: they answer trainer rank 0's requests on the
transfer group and never build megatron, the data or a reward pool. Trainer rank 0 sends the run's
resolved config once the run is prepared (``start``, so the demo's files exist and every engine
loads the same model); per generation batch a request (``generate``: each engine replica generates
its contiguous share, seeded by the prompts' global positions as colocated replicas are) and, when
it needs the results, ``collect`` (the replica leaders' results come back in replica order; a stop
asks ``ready`` first, without waiting; ``cancel`` names batches nobody will collect); per
weight sync the export's stream (``weights``, with its version); ``stop`` when the run ends.

An engine rank does the work in a thread of its own, strictly in the order asked, while its main
thread keeps the transfer group's collectives in the trainers' order. So a ``generate`` returns at
once and the trainers go on training (rollout.max_staleness >= 1: rollout/pipeline.py), and a
weight stream that arrives while a batch is generating is held in host memory and loaded after
that batch: every batch is generated from the weights that were current when it was asked for,
and its rollouts carry that version. Each result also carries the engine's idle seconds, and the
trainer rank measures how long it waited in ``collect``: the step's wait metrics.

On the trainers, ``SeparatePlacement`` stands where ``RolloutPlacement`` stands colocated, with
the same methods plus ``submit``/``collect``: one logical replica spanning every trainer rank,
whose leader (trainer rank 0) receives every result and scores it; ``gather`` then hands the
leader's summaries to every trainer rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.engine import GenerationAborted, Rollout, SamplingParams
from megatron_dapo.rollout.placement import gather_all, replica_layout, shard_range, stamp
from megatron_dapo.rollout.weight_sync import finish_update
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
        self._requests = 0  # request ids, in the order asked
        self._waited = self._idle = 0.0  # since take_waits: trainer rank 0 in collect, the engines idle

    def start(self, cfg) -> None:
        """The engines build their engine from the run's resolved config (collective with them)."""
        if self.split.transfer is not None:
            broadcast_object(self.split, ("start", cfg))

    def submit(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        """Asks the engines for a generation batch and returns at once: the request's id for
        ``collect`` (every trainer rank calls it; only the leader sends)."""
        self._requests += 1
        if self.is_leader:
            broadcast_object(self.split, ("generate", self._requests, [list(p) for p in prompt_ids], n, params))
        return self._requests

    def collect(self, request: int) -> tuple[range, list[list[Rollout]]]:
        """A submitted batch's rollouts on the leader, in prompt order (waits for them); elsewhere none."""
        if not self.is_leader:
            return range(0), []
        started = time.monotonic()
        broadcast_object(self.split, ("collect", request))
        parts = allgather_objects(self.split, None)[1:]  # the engines', in engine rank order
        self._waited += time.monotonic() - started
        self._idle += max(idle for _, idle in parts)
        groups = [group for part, _ in parts if part is not None for group in part]
        return range(len(groups)), groups

    def ready(self, request: int) -> bool:
        """Whether every engine rank has finished a submitted batch (the leader asks without waiting;
        elsewhere False): a stop's wait for what is in flight (rollout/pipeline.py)."""
        if not self.is_leader:
            return False
        broadcast_object(self.split, ("ready", request))
        return all(allgather_objects(self.split, None)[1:])

    def cancel(self, requests: Sequence[int]) -> None:
        """Submitted batches nobody will collect (a generation budget spent with batches asked for
        ahead): the engines abort them (or, queued, end them at once) and serve on (every trainer
        rank calls it; only the leader sends)."""
        if self.is_leader and requests:
            broadcast_object(self.split, ("cancel", list(requests)))

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> tuple[range, list[list[Rollout]]]:
        """On the leader every prompt's rollouts (from the engine replicas); elsewhere none."""
        return self.collect(self.submit(prompt_ids, n, params))

    def take_waits(self) -> dict[str, float]:
        """Seconds trainer rank 0 waited in ``collect`` and the engines sat idle (the most idle
        replica) since the last call."""
        waits = {"timing_s/trainer_waited": self._waited, "timing_s/engines_idle": self._idle}
        self._waited = self._idle = 0.0
        return waits

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

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             version: int | None = None) -> dict[str, int]:
        """Every trainer rank runs the export; trainer rank 0 streams it to every engine rank,
        which loads it after the batches asked for before it."""
        if self.split.transfer is not None:
            broadcast_object(self.split, ("weights", version))
        return send_weights(self.split, weights, bucket_bytes)

    def sleep(self) -> None:
        """Nothing to release: the engines' memory is not the trainers'."""

    def wake_up(self) -> None:
        """See sleep()."""


class _Held:
    """A weight stream received while the engine may be generating: its buckets, in host memory,
    for the worker to load in order (the update_weights/finish_weight_update of an engine)."""

    def __init__(self):
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []

    def update_weights(self, bucket) -> None:
        self.buckets.append([(name, t.cpu()) for name, t in bucket])

    def finish_weight_update(self) -> None:
        """Nothing to finish until the worker loads the buckets."""


class _Worker(threading.Thread):
    """An engine rank's engine, doing what it is asked strictly in order (module doc)."""

    def __init__(self, split: WorldSplit):
        super().__init__(name="engine-worker", daemon=True)
        self.split = split
        self.work: queue.Queue = queue.Queue()
        self.results: dict[int, tuple[list | None, float]] = {}
        self.error: BaseException | None = None
        self.served = 0
        self.engine = None  # once built; the main thread aborts it at a stop or a cancel
        self.aborts = False  # whether the run's engine class can abort (known at "start")
        self.stopping = False
        self.cancelled: set[int] = set()  # requests nobody will collect; the engine serves on
        self._current: int | None = None  # the generation request the worker runs
        self._done = threading.Condition()  # also guards stopping, cancelled, _current and the abort flag

    def run(self) -> None:
        engine, version, idle = None, 0, 0.0
        try:
            while True:
                waiting = time.monotonic()
                item = self.work.get()
                if engine is not None:
                    idle += time.monotonic() - waiting
                kind = item[0]
                if kind == "start":
                    engine, leader, replica, num_replicas = self._build(item[1])
                    self.engine = engine
                    if self.stopping and engine.aborts:  # a stop came while it was built
                        engine.abort()
                elif kind == "generate":
                    request, prompt_ids, n, params = item[1:]
                    share = shard_range(len(prompt_ids), replica, num_replicas)
                    self._enter(request)
                    try:
                        out = engine.generate([prompt_ids[i] for i in share], n, params, prompt_indices=list(share))
                    except GenerationAborted:  # a stop or a cancel (here, or on its replica's other ranks)
                        logger.info("engine rank %d: generation request %d %s", self.split.side_rank, request,
                                    "aborted at the stop" if self.stopping else "cancelled, aborted")
                        continue  # nobody collects it; the stop comes after the requests still queued
                    finally:
                        self._current = None
                    with self._done:
                        if request not in self.cancelled:  # else finished before the cancel reached it
                            self.results[request] = (stamp(out, version) if leader else None, idle)
                            self.served += 1
                        self._done.notify_all()
                    idle = 0.0
                elif kind == "weights":
                    for bucket in item[2]:
                        engine.update_weights(bucket)
                    finish_update(engine)
                    version = item[1] if item[1] is not None else version
                else:  # stop
                    if engine is not None:
                        engine.shutdown()
                    return
        except BaseException as error:  # raised on the main thread at the next collect
            with self._done:
                self.error = error
                self._done.notify_all()

    def _enter(self, request: int) -> None:
        """Before generating ``request``: the engine's abort flag says whether nobody will collect it
        (a stop, a cancel), set or cleared under the lock that ``cancel`` and ``abort`` take, so that
        neither lands on the request after the one it meant. Every rank enters every request, an
        aborted one too: vLLM's replicas step together."""
        with self._done:
            self._current = request
            if self.stopping or request in self.cancelled:
                if self.engine.aborts:
                    self.engine.abort()
            elif self.engine.aborts:
                self.engine.clear_abort()

    def cancel(self, requests: Sequence[int]) -> None:
        """Generation requests nobody will collect (SeparatePlacement.cancel): the one generating is
        aborted, a queued one ends at once when the worker takes it, a finished one's result goes."""
        with self._done:
            self.cancelled.update(requests)
            for request in requests:
                self.results.pop(request, None)
            if self._current in self.cancelled and self.engine is not None and self.engine.aborts:
                self.engine.abort()

    def _build(self, cfg):
        from megatron_dapo.rollout.engine import get_engine_cls

        if cfg.num_threads:  # what prepare_run does on the trainers (engines never run it)
            torch.set_num_threads(cfg.num_threads)
        tp = cfg.rollout.tensor_parallel_size
        replica, num_replicas, leader = replica_layout(self.split.side_rank, self.split.num_engines, tp)
        # vLLM's external launcher reads the launcher's variables: here they must be the engines' world's
        os.environ.update(RANK=str(self.split.side_rank), WORLD_SIZE=str(self.split.num_engines))
        engine = get_engine_cls(cfg.rollout.engine).from_config(str(cfg.model.hf_path), cfg)
        logger.info("engine rank %d: rollout replica %d of %d (%s engine)%s", self.split.side_rank, replica,
                    num_replicas, cfg.rollout.engine, ", answering" if leader else "")
        return engine, leader, replica, num_replicas

    def result(self, request: int) -> tuple[list | None, float]:
        """The request's (rollouts on a replica leader, else None; idle seconds before it), waiting."""
        with self._done:
            while request not in self.results:
                self.raise_error()
                self._done.wait()
            return self.results.pop(request)

    def done(self, request: int) -> bool:
        """Whether ``request``'s result is there (or the worker failed: the collect raises it)."""
        with self._done:
            return request in self.results or self.error is not None

    def raise_error(self) -> None:
        """The worker's failure, raised here (on the main thread) when there is one."""
        if self.error is not None:
            raise RuntimeError(f"engine rank {self.split.side_rank} failed") from self.error

    def drop_pending(self) -> None:
        """At a stop, forgets the work not yet started that nobody needs: weight loads (no batch will
        be collected) and, when the engine cannot abort, everything. An engine that aborts keeps its
        generation requests and ends each at once: every rank must take part in each (vLLM's replicas
        step together), which a rank that dropped one another rank's worker had already taken broke."""
        kept = []
        while True:
            try:
                item = self.work.get_nowait()
            except queue.Empty:
                break
            if self.aborts and item[0] in ("start", "generate"):
                kept.append(item)
        for item in kept:
            self.work.put(item)

    def abort(self) -> None:
        """Ends the batch the engine is generating and those still queued, if the engine can (its
        ``aborts``): at the stop nobody collects them, and its rank would otherwise finish them before
        exiting (minutes at scale, past a preempted job's kill). An engine still being built is aborted
        once built."""
        with self._done:
            self.stopping, engine = True, self.engine
            if engine is not None and engine.aborts:
                engine.abort()
        if engine is not None and not engine.aborts and self._current is not None:
            logger.warning("engine rank %d: its engine cannot abort the generation batch in flight; the rank "
                           "exits once it is done", self.split.side_rank)


def serve(split: WorldSplit) -> int:
    """An engine rank's whole run: build the engine at ``start``, answer until ``stop``; returns
    the number of generation requests served. The engine's alarm-dump share differs from a colocated
    run's: one leader caps flagged rows over the whole batch (observe/observer.py), not per replica."""
    worker = _Worker(split)
    worker.start()
    try:
        # On a GPU the transfer group's waits hold the stream they are issued on: a stream of their
        # own keeps the worker's generation (on the default stream) from queueing behind the wait
        # for the next request (unverified: no GPU was lent).
        with torch.cuda.stream(torch.cuda.Stream()) if split.device.type == "cuda" else contextlib.nullcontext():
            _answer(split, worker)
    finally:  # the worker ends with the loop, however it ends, aborting the work nobody will collect
        worker.drop_pending()
        worker.abort()
        worker.work.put(("stop",))
        worker.join(timeout=600)
        if worker.is_alive():
            logger.warning("engine rank %d: the engine did not end within 600 s of the stop; leaving it",
                           split.side_rank)
    worker.raise_error()
    return worker.served


def _answer(split: WorldSplit, worker: _Worker) -> None:
    """The transfer group's side of ``serve``: every request in the trainers' order; the work to the
    worker, results back when collected."""
    while True:
        request = broadcast_object(split)
        kind = request[0]
        if kind == "start":
            from megatron_dapo.rollout.engine import get_engine_cls

            worker.aborts = get_engine_cls(request[1].rollout.engine).aborts
        if kind in ("start", "generate"):
            worker.work.put(request)
        elif kind == "collect":
            allgather_objects(split, worker.result(request[1]))
        elif kind == "cancel":
            worker.cancel(request[1])
        elif kind == "ready":
            allgather_objects(split, worker.done(request[1]))
        elif kind == "weights":
            held = _Held()
            receive_weights(split, held)
            worker.work.put(("weights", request[1], held.buckets))
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"engine rank {split.side_rank}: unknown request {kind!r}")
