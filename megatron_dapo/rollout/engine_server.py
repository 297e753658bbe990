"""An engine rank of a separate placement: its whole run (``serve``).

The engine ranks never build megatron, the data or a reward pool. Two threads:

- the main thread reads trainer rank 0's requests (rollout/protocol.py) from the control channel
  and hands the work to the worker; it answers ``Collect`` (a replica leader sends its rollouts to
  trainer rank 0) and passes on ``Stream``, ``Cancel`` and ``Stop``. It touches no device.
- the worker thread builds the engine and does the work strictly in the order asked: generation
  batches and weight versions. It is the one thread that drives this rank's device: vLLM's
  collectives run in it, and so does the weight stream (rollout/weight_stream.py), received
  between generation batches. It binds the rank's device first (a thread starts on GPU 0: CUDA's
  current device is per thread).

A weight version asked for while a batch generates waits its turn: the worker finishes the batches
asked for before it, counts itself done with the version (rollout/protocol.Progress), and waits
for trainer rank 0's ``Stream``, sent once every worker is there; the trainers wait for that in
the sync (rollout/separate.py). So every batch is generated from the weights that were current
when it was asked for, and its rollouts carry that version.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

import torch

from megatron_dapo.rollout.channel import ChannelClosed, send_object
from megatron_dapo.rollout.engine import EngineSpec, GenerationAborted
from megatron_dapo.rollout.placement import replica_layout, shard_range, with_version
from megatron_dapo.rollout.protocol import Cancel, Collect, Generate, Start, Stop, Stream, Weights
from megatron_dapo.rollout.weight_stream import receive_weights, reserve_bucket
from megatron_dapo.rollout.worlds import WorldSplit

logger = logging.getLogger(__name__)
JOIN_S = 600.0  # how long the main thread waits for the worker after a stop before it leaves it


class Worker(threading.Thread):
    """An engine rank's engine, doing what it is asked strictly in order (module doc)."""

    def __init__(self, split: WorldSplit):
        super().__init__(name="engine-worker", daemon=True)
        self.split, self.links = split, split.links
        self.work: queue.Queue = queue.Queue()
        self.results: dict[int, tuple[list | None, float]] = {}
        self.error: BaseException | None = None
        self.served = 0
        self.engine = None  # once built; the main thread aborts it at a stop or a cancel
        self.aborts = False  # whether the run's engine class can abort (known at Start)
        self.stopping = False
        self.cancelled: dict[int, str] = {}  # requests nobody will collect, and why; the engine serves on
        self._current: int | None = None  # the generation request the worker runs
        # released by trainer rank 0's Stream (or the stop) for the weight version the worker waits at
        self._streams = threading.Semaphore(0)
        self._done = threading.Condition()  # guards stopping, cancelled, _current and the abort flag

    def run(self) -> None:
        engine, version, idle = None, 0, 0.0
        try:
            if self.split.device.type == "cuda":
                torch.cuda.set_device(self.split.device)
            while True:
                waiting = time.monotonic()
                item = self.work.get()
                if engine is not None:
                    idle += time.monotonic() - waiting
                if isinstance(item, Start):
                    engine, leader, replica, num_replicas = self._build(item.spec)
                    self.engine = engine
                    if self.stopping and engine.aborts:  # a stop came while it was built
                        engine.abort()
                elif isinstance(item, Generate):
                    if self._generate(engine, item, leader, replica, num_replicas, version, idle):
                        idle = 0.0
                    self.links.progress.done(item.request)
                elif isinstance(item, Weights):
                    # every batch asked for before it is generated; the first bucket's memory is there
                    # (a failure now is reported before trainer rank 0 starts the stream, not in it)
                    reserve_bucket(self.links, item.bucket_bytes)
                    self.links.progress.done(item.request)
                    self._streams.acquire()  # trainer rank 0's Stream, once every worker is here, or the stop
                    if self.stopping:
                        continue
                    stats = receive_weights(self.links, engine)
                    version = item.version if item.version is not None else version
                    logger.debug("engine rank %d: weight version %s loaded (%d buckets)",
                                 self.split.side_rank, version, stats["num_buckets"])
                else:  # Stop
                    if engine is not None:
                        engine.shutdown()
                    return
        except BaseException as error:  # trainer rank 0 reads it from the progress counters
            with self._done:
                self.error = error
                self._done.notify_all()
            try:
                self.links.progress.fail(self.split.side_rank, error)
            except Exception:  # noqa: BLE001 -- the store may be gone with the trainers
                logger.exception("engine rank %d: could not report its failure", self.split.side_rank)

    def _generate(self, engine, item: Generate, leader: bool, replica: int, num_replicas: int, version: int,
                  idle: float) -> bool:
        """Generates this replica's share of ``item``; whether it finished (else it was aborted)."""
        share = shard_range(len(item.prompt_ids), replica, num_replicas)
        self._enter(item.request)
        try:
            out = engine.generate([item.prompt_ids[i] for i in share], item.n, item.params,
                                  prompt_indices=list(share))
        except GenerationAborted:  # a stop or a cancel (here, or on its replica's other ranks)
            why = self.cancelled.get(item.request, "aborted at the stop" if self.stopping else "aborted")
            logger.info("engine rank %d: generation request %d %s", self.split.side_rank, item.request,
                        why if why.startswith("aborted") else f"{why}, aborted")
            return False
        finally:
            with self._done:
                self._current = None
        with self._done:
            if item.request not in self.cancelled:  # else finished before the cancel reached it
                self.results[item.request] = (with_version(out, version) if leader else None, idle)
                self.served += 1
            self._done.notify_all()
        return True

    def _enter(self, request: int) -> None:
        """Before generating ``request``: the engine's abort flag says whether nobody will collect it
        (a stop, a cancel), set or cleared under the lock that ``cancel`` and ``abort`` take, so that
        neither lands on the request after the one it meant. Every rank enters every request, an
        aborted one too: vLLM's replicas step together."""
        with self._done:
            self._current = request
            for old in [r for r in self.cancelled if r < request]:  # passed: nothing will ask again
                del self.cancelled[old]
            if self.stopping or request in self.cancelled:
                if self.engine.aborts:
                    self.engine.abort()
            elif self.engine.aborts:
                self.engine.clear_abort()

    def stream(self) -> None:
        """Trainer rank 0 streams the weight version the worker waits at (protocol.Stream)."""
        self._streams.release()

    def cancel(self, requests: Sequence[int], why: str = "cancelled") -> None:
        """Generation requests nobody will collect (SeparatePlacement.cancel): the one generating is
        aborted, a queued one ends at once when the worker takes it, a finished one's result goes.
        ``why`` goes to the log."""
        with self._done:
            self.cancelled.update(dict.fromkeys(requests, why))
            for request in requests:
                if self.results.pop(request, None) is not None:
                    logger.info("engine rank %d: generation request %d %s, its result dropped",
                                self.split.side_rank, request, why)
            if self._current in self.cancelled and self.engine is not None and self.engine.aborts:
                self.engine.abort()

    def _build(self, spec: EngineSpec):
        from megatron_dapo.rollout.engine import get_engine_cls

        if spec.num_threads:  # what prepare_run does on the trainers (engines never run it)
            torch.set_num_threads(spec.num_threads)
        tp = spec.rollout.tensor_parallel_size
        replica, num_replicas, leader = replica_layout(self.split.side_rank, self.split.num_engines, tp)
        # vLLM's external launcher reads the launcher's variables: here they must be the engines' world's
        os.environ.update(RANK=str(self.split.side_rank), WORLD_SIZE=str(self.split.num_engines))
        engine = get_engine_cls(spec.rollout.engine).from_spec(spec)
        logger.info("engine rank %d: rollout replica %d of %d (%s engine)%s", self.split.side_rank, replica,
                    num_replicas, spec.rollout.engine, ", answering" if leader else "")
        return engine, leader, replica, num_replicas

    def result(self, request: int) -> tuple[list | None, float]:
        """The request's (rollouts on a replica leader, else None; idle seconds before it): trainer
        rank 0 asks only once every worker counted itself done with it (and none failed), so it is
        there."""
        with self._done:
            if request not in self.results:
                self.raise_error()
            return self.results.pop(request)

    def raise_error(self) -> None:
        """The worker's failure, raised here (on the main thread) when there is one."""
        if self.error is not None:
            raise RuntimeError(f"engine rank {self.split.side_rank} failed") from self.error

    def drop_pending(self) -> None:
        """At a stop, forgets the work not yet started that nobody needs: weight versions (no batch
        will be collected) and, when the engine cannot abort, everything. An engine that aborts keeps
        its generation requests and ends each at once: every rank must take part in each (vLLM's
        replicas step together), which a rank that dropped one another rank's worker had already
        taken broke."""
        kept = []
        while True:
            try:
                item = self.work.get_nowait()
            except queue.Empty:
                break
            if self.aborts and isinstance(item, (Start, Generate)):
                kept.append(item)
        for item in kept:
            self.work.put(item)

    def abort(self) -> None:
        """Ends the batch the engine is generating and those still queued, if the engine can (its
        ``aborts``), and a wait for a weight stream that will not come: at the stop nobody collects
        them, and its rank would otherwise finish them before exiting (minutes at scale, past a
        preempted job's kill). An engine still being built is aborted once built."""
        with self._done:
            self.stopping, engine = True, self.engine
            if engine is not None and engine.aborts:
                engine.abort()
        self._streams.release()
        if engine is not None and not engine.aborts and self._current is not None:
            logger.warning("engine rank %d: its engine cannot abort the generation batch in flight; the rank "
                           "exits once it is done", self.split.side_rank)


def serve(split: WorldSplit) -> int:
    """An engine rank's whole run: build the engine at ``Start``, answer until ``Stop``; returns the
    number of generation requests served. The engine's alarm-dump share differs from a colocated
    run's: one leader caps flagged rows over the whole batch (observe/observer.py), not per replica."""
    worker = Worker(split)
    worker.start()
    failed = True
    try:
        _answer(split, worker)
        failed = False
    except BaseException as error:
        if worker.error is not None:
            worker.raise_error()  # the root cause, whatever the main thread met after it
        if not isinstance(error, ChannelClosed):  # the main thread's own: trainer rank 0 reads it next
            try:
                split.links.progress.fail(split.side_rank, error)
            except Exception:  # noqa: BLE001 -- the store may be gone with the trainers
                pass
        raise
    finally:  # the worker ends with the loop, however it ends, aborting the work nobody will collect
        worker.drop_pending()
        worker.abort()
        worker.work.put(Stop())
        worker.join(timeout=JOIN_S)
        if worker.is_alive():
            logger.warning("engine rank %d: the engine did not end within %.0f s of the stop; leaving it",
                           split.side_rank, JOIN_S)
        split.close(failed=failed or worker.error is not None or worker.is_alive())
    worker.raise_error()
    return worker.served


def _answer(split: WorldSplit, worker: Worker) -> None:
    """The control channel's side of ``serve``: every request in trainer rank 0's order; the work to
    the worker, a replica leader's rollouts to trainer rank 0 when collected."""
    control, leader = split.links.control, False
    while True:
        message = control.receive()
        match message:
            case Start(spec=spec):
                from megatron_dapo.rollout.engine import get_engine_cls

                worker.aborts = get_engine_cls(spec.rollout.engine).aborts
                tp = spec.rollout.tensor_parallel_size
                leader = replica_layout(split.side_rank, split.num_engines, tp)[2]
                worker.work.put(message)
            case Generate() | Weights():
                worker.work.put(message)
            case Stream():
                worker.stream()
            case Collect(request=request):
                if leader:
                    send_object(control.group, worker.result(request), 0)
                else:  # its (None, idle) entry, never sent
                    worker.results.pop(request, None)
            case Cancel(requests=requests, why=why):
                worker.cancel(requests, why)
            case Stop():
                return
            case _:
                raise RuntimeError(f"engine rank {split.side_rank}: unknown request {message!r}")
