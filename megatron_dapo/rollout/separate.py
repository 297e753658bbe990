"""Separate placement, the trainers' side: ``SeparatePlacement``, the ``Placement`` (rollout/placements.py)
of trainer ranks whose engines hold ranks of their own; its ``submit``/``collect``/``wait_for``/``cancel``
let the engines generate while the trainers train.

The engine ranks (rollout/engine_server.py) answer trainer rank 0's requests (rollout/protocol.py).
Trainer rank 0 sends the run's resolved config once the run is prepared (``Start``, so the demo's
files exist and every engine loads the same model); per generation batch a request (``Generate``:
each engine replica generates its contiguous share, seeded by the prompts' global positions as
colocated replicas are), which returns at once, and, when it needs the results, ``collect``
(replica leaders send them, in replica order); per weight sync the export's stream, once every
engine has generated what was asked for before it; ``Stop`` when the run ends. One logical replica
spans every trainer rank: its leader, trainer rank 0, receives every result and scores it;
``gather`` then hands the leader's summaries to every trainer rank.

Every wait for the engines' work is trainer rank 0 polling the store's progress counters (never a
collective: a generation batch outlasts any collective's timeout), up to
``rollout.wait_timeout_minutes``; the other trainer ranks wait for rank 0 in the store too, through
the trainers' channel (rollout/channel.py). Each result carries the engine's idle seconds, and
trainer rank 0 measures how long it waited: the step's wait metrics.

A stop cuts a generating step short (``abort``, from a stop's watchdog thread; preemption.py): the
weights do not change while the engines generate, so the state as of the step's start is saved and
the step redone on resume. Trainer rank 0's poll for a batch sees the cut (its own, or one another
trainer rank asked for through the store: ``CutRequests``), cancels the batch on the engines, which
abort it and serve on, and sends the other trainer ranks ``Cut`` where they wait for the batch's
results; every trainer rank then raises GenerationAborted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from megatron_dapo.rollout.channel import WaitTimeout, gather_objects, recv_object
from megatron_dapo.rollout.engine import EngineSpec, GenerationAborted, Rollout, SamplingParams
from megatron_dapo.rollout.placement import CUT_SHORT, replica_layout
from megatron_dapo.rollout.protocol import Cancel, Collect, Generate, Start, Stop, Stream, Weights
from megatron_dapo.rollout.weight_stream import send_weights
from megatron_dapo.rollout.worlds import EngineLinks, WorldSplit

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron_dapo.rollout.gen_progress import ProgressSink

logger = logging.getLogger(__name__)
POLL_S = (0.001, 0.05)  # trainer rank 0's polls of the progress counters: the first pause, the longest


class RemoteEngines:
    """The remote engines, as the trainers hold them: ``shutdown`` (trainer rank 0 tells them to
    stop, and every trainer rank closes its links; once, however the run ends, also before they
    were started)."""

    def __init__(self, split: WorldSplit):
        self.split, self.stopped = split, False

    def shutdown(self, *, failed: bool = False) -> None:
        """``failed``: the trainers end on an error: their channels are closed rather than sent a
        last message (a receiver may not be listening), and the links aborted. Never raises: it
        runs on exit paths, where the error that brought the run there is the one to report."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if failed:
                self.close_channels()
            elif self.split.links is not None:
                self.split.links.control.send(Stop())
        except Exception:  # noqa: BLE001 -- logged; the engines end when this process does
            logger.exception("could not tell the engines to stop")
        finally:
            self.split.close(failed=failed)

    def close_channels(self) -> None:
        """Trainer rank 0 leaves mid-run (a failure, a step abandoned at a stop): every engine rank
        and trainer rank waiting for its next message ends at once (channel.ChannelClosed)."""
        for channel in (self.split.links.control if self.split.links else None, self.split.trainers):
            if channel is not None and self.split.side_rank == 0:
                channel.close()


@dataclass(frozen=True)
class Cut:
    """Trainer rank 0 to the other trainer ranks, where they wait for a batch's results: a stop cut
    the step's generation short."""


class CutRequests:
    """A stop's request to cut the step's generation short, from any trainer rank to trainer rank 0
    (a rank may get the signal alone): a counter in the store. ``ask`` never waits, so a watchdog
    thread may call it while its main thread waits in a channel (a store client of its own:
    worlds.split_world); rank 0 reads it at each poll for a batch, without waiting either."""

    KEY = "asked"

    def __init__(self, store: dist.Store) -> None:
        self.store, self.seen = store, 0

    def ask(self) -> None:
        self.store.add(self.KEY, 1)

    def asked(self) -> bool:
        """Trainer rank 0: a request since the last ``forget``."""
        return self.store.add(self.KEY, 0) > self.seen

    def forget(self) -> None:
        """Trainer rank 0, as a step's generation begins: the requests so far came too late to cut
        the last one (a stop then ends the run after its step, preemption.py)."""
        self.seen = self.store.add(self.KEY, 0)


class SeparatePlacement:
    """The trainers' rollout placement when the engines hold ranks of their own (module doc)."""

    def __init__(self, engines: RemoteEngines):
        split = self.split = engines.split
        self.rank, self.world_size = split.side_rank, split.num_trainers
        self.replica, self.num_replicas, self.is_leader = 0, 1, split.side_rank == 0
        self._requests = 0  # request ids, in the order asked (generation batches and weight versions)
        self._leaders: list[int] = []  # the engine ranks that answer for a replica (known at start)
        self._cancelled: list[int] = []  # their progress counters go once a later request is done
        self._aborted = threading.Event()  # set by ``abort`` (a stop's watchdog thread), until ``clear_abort``
        self._cuts = CutRequests(split.cuts) if split.cuts is not None else None
        self._armed = False  # trainer rank 0: a step's generation runs (arm_abort .. clear_abort)
        self._waited = self._idle = 0.0  # since take_waits: trainer rank 0 waiting, the engines idle
        self.wait_s = split.wait_s  # trainer rank 0's limit on a wait for the engines

    def start(self, cfg: Any) -> None:
        """The engines build their engine from the run's resolved config."""
        if self.is_leader:
            tp = cfg.rollout.tensor_parallel_size
            engines = self.split.num_engines
            self._leaders = [e for e in range(engines) if replica_layout(e, engines, tp)[2]]
            self._links.control.send(Start(EngineSpec.of(cfg)))

    def submit(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        """Asks the engines for a generation batch and returns at once: the request's id for
        ``collect`` (every trainer rank calls it; only the leader sends)."""
        request = self._next()
        if self.is_leader:
            self._links.control.send(Generate(request, [list(p) for p in prompt_ids], n, params))
        return request

    def collect(self, request: int) -> tuple[range, list[list[Rollout]]]:
        """A submitted batch's rollouts on the leader, in prompt order (waits for them); elsewhere none.
        A stop's cut while the leader waits: GenerationAborted here on the leader, in the ``gather``
        that follows on the other trainer ranks."""
        if not self.is_leader:
            return range(0), []
        if not self._await(request, self._cut_deadline):
            self._cut(request)
        links = self._links
        links.control.send(Collect(request))
        parts = [recv_object(links.control.group, 1 + engine) for engine in self._leaders]  # replica order
        links.progress.forget(request)
        self._idle += max(idle for _, idle in parts)
        groups = [group for part, _ in parts for group in part]
        return range(len(groups)), groups

    def wait_for(self, requests: Sequence[int], until: Callable[[], float | None] = lambda: None) -> int:
        """How many of ``requests`` (submitted batches, in the order asked), from the first, every engine
        has finished by ``until()`` (a time.monotonic() deadline, read at every poll; None: none),
        on every trainer rank (the leader polls, the others wait for its word in the store)."""
        count = 0
        if self.is_leader:
            limit = time.monotonic() + self.wait_s  # one limit for the whole wait: the others wait once
            for request in requests:
                if not self._await(request, until, limit):
                    break
                count += 1
        return self._share(count)

    def cancel(self, requests: Sequence[int], why: str = "cancelled") -> None:
        """Submitted batches nobody will collect (a generation budget spent with batches asked for
        ahead, a stop that releases them; ``why`` says which in the engines' log): the engines abort
        them (or, queued, end them at once) and serve on (every trainer rank calls it; only the
        leader sends)."""
        if self.is_leader and requests:
            self._links.control.send(Cancel(tuple(requests), why))
            self._cancelled += requests

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> tuple[range, list[list[Rollout]]]:
        """On the leader every prompt's rollouts (from the engine replicas); elsewhere none."""
        return self.collect(self.submit(prompt_ids, n, params))

    def take_waits(self) -> dict[str, float]:
        """Seconds trainer rank 0 waited for the engines and the engines sat idle (the most idle
        replica) since the last call."""
        waits = {"timing_s/trainer_waited": self._waited, "timing_s/engines_idle": self._idle}
        self._waited = self._idle = 0.0
        return waits

    def gather(self, local: list) -> list:
        """The leader's ``local`` on every trainer rank."""
        return self._share(list(local))

    def gather_all(self, item: Any) -> list:
        """Every trainer rank's ``item``, in rank order, on every trainer rank (small objects, every
        rank at the same point)."""
        if self.split.trainers is None:
            return [item]
        return gather_objects(self.split.trainers.group, self.world_size, torch.device("cpu"), item)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             version: int | None = None) -> dict[str, int]:
        """Every trainer rank runs the export; trainer rank 0 streams it to every engine rank once
        the engines have generated every batch asked for before it (the wait is rank 0's poll; the
        other trainer ranks wait for its word before the export's first collective)."""
        request = self._next()
        if self.is_leader:
            self._links.control.send(Weights(request, version, bucket_bytes))
            self._await(request)
            self._links.progress.forget(request)
        self._share(None)  # the others start the export: its first collective waits for rank 0 alone
        if self.is_leader:
            self._links.control.send(Stream(request))  # from here on send_weights tells the engines if it fails
        return send_weights(self.split.links, weights, bucket_bytes)

    def from_leader(self, items: list) -> list:
        """``items`` as they are: only the leader sends a request."""
        return items

    def sleep(self) -> None:
        """Nothing to release: the engines' memory is not the trainers'."""

    def wake_up(self) -> None:
        """See sleep()."""

    def shutdown(self) -> None:
        """Nothing here: ``RemoteEngines.shutdown`` (train.py) tells the engines, once it knows how the run ended."""

    aborts = True  # abort() below

    def abort(self) -> bool:
        """Cuts the step's generation short (``Placement.abort``; module doc): trainer rank 0 stops
        waiting at its next poll for a batch; another trainer rank asks it through the store (False
        when the store cannot be reached: the stop's watchdog then treats the step as uncuttable)."""
        if not self.is_leader and self._cuts is not None:
            try:
                self._cuts.ask()
            except Exception:  # noqa: BLE001 -- a stop's watchdog thread must live on to abandon the step
                logger.exception("could not ask trainer rank 0 to cut the step short")
                return False
        self._aborted.set()
        return True

    def arm_abort(self) -> None:
        """A step's generation begins (``Placement.arm_abort``): trainer rank 0 reads the cut
        requests from here on, those asked for before (a stop that came too late for the last
        step's generation, which then ended the run after it) forgotten."""
        if self.is_leader:
            if self._cuts is not None:
                self._cuts.forget()
            self._armed = True

    def clear_abort(self) -> None:
        """The step's generation ended before a cut reached its polls: the step goes on, and a
        request that comes later (another rank's signal, just after) cuts nothing, the evaluation
        included."""
        self._aborted.clear()
        self._armed = False

    def report_progress(self, sink: ProgressSink | None) -> None:
        """Not here: the engines run in processes of their own; the trainers show which batch they
        wait for (step_batches.py)."""

    # ------------------------------------------------------------------ trainer rank 0's waits
    @property
    def _links(self) -> EngineLinks:
        """Trainer rank 0's links to the engines. Only trainer rank 0 holds them (``WorldSplit.links``
        is None on the others), and only its code paths (``is_leader``) read them here."""
        return cast(EngineLinks, self.split.links)

    def _cut_deadline(self) -> float | None:
        """A deadline already passed once a cut is asked for (``_await``'s ``until``), else none."""
        asked = self._aborted.is_set() or (self._armed and self._cuts is not None and self._cuts.asked())
        return 0.0 if asked else None

    def _cut(self, request: int) -> NoReturn:
        """Trainer rank 0, cut short while it waited for ``request``: the engines abort it, the other
        trainer ranks learn of it where they wait, and every trainer rank leaves the step's
        generation. ``request`` is the step's own: the batches asked for ahead in earlier steps are
        finished (the last sync waited for them), and the cut's save collects them."""
        self.cancel([request], "cut short at a stop")
        self._share(Cut())
        raise GenerationAborted(CUT_SHORT)

    def _next(self) -> int:
        self._requests += 1
        return self._requests

    def _await(self, request: int, until: Callable[[], float | None] = lambda: None,
               limit: float | None = None) -> bool:
        """Polls until every engine is done with ``request`` (True), or ``until()`` has passed
        (False); raises an engine's failure, or WaitTimeout at ``limit`` (time.monotonic(); default
        ``rollout.wait_timeout_minutes`` from now)."""
        progress, engines = self._links.progress, self.split.num_engines
        started = time.monotonic()
        limit = started + self.wait_s if limit is None else limit
        pause = POLL_S[0]
        try:
            while (done := progress.count(request)) < engines:
                if failures := progress.failures():
                    raise failures[0].error()
                now = time.monotonic()
                deadline = until()
                if deadline is not None and now >= deadline:
                    return False
                if now > limit:
                    missing = f"{engines - done} of {engines} engine ranks have not finished it"
                    waited = f"trainer rank 0 waited {self.wait_s / 60:.1f} min for request {request}"
                    raise WaitTimeout(f"{waited}: {missing} (rollout.wait_timeout_minutes; the engine ranks' "
                                      "logs say what they do)")
                time.sleep(pause)
                pause = min(2 * pause, POLL_S[1])
            if failures := progress.failures():  # done, then failed on what came after it
                raise failures[0].error()
            for old in [r for r in self._cancelled if r < request]:  # every engine has passed them
                progress.forget(old)
                self._cancelled.remove(old)
            return True
        finally:
            self._waited += time.monotonic() - started

    def _share(self, value: Any) -> Any:
        """Trainer rank 0's ``value`` on every trainer rank (the others wait for it in the store)."""
        channel = self.split.trainers
        if channel is None:
            return value
        if self.is_leader:
            channel.send(value)
            return value
        value = channel.receive()
        if isinstance(value, Cut):
            raise GenerationAborted(CUT_SHORT)
        return value
