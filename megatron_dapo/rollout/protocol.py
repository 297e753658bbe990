"""What trainer rank 0 and the engine ranks of a separate placement say to each other.

Requests travel from trainer rank 0 to every engine rank on the control channel
(rollout/channel.py: a doorbell in the store, the message in one gloo broadcast), each a typed
message below; every engine rank's main thread reads them in order and hands the work to its
worker thread (rollout/engine_server.py). What comes back:

- progress, in the store (``Progress``): a worker counts itself done with a request (a generation
  batch generated or aborted; a weight version it is ready to receive), or failed, and trainer
  rank 0 reads the counts without waiting, as often as it likes;
- a generation batch's rollouts, from each replica's leader to trainer rank 0 alone, over the
  control channel's gloo group (send/recv), once trainer rank 0 has seen them all done;
- weights go the other way, as a stream (rollout/weight_stream.py) that the workers receive
  between generation batches.

Request ids count every generation batch and weight version asked for, in the order asked; an
engine's worker takes them strictly in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.engine import EngineSpec, SamplingParams

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class Start:
    """Build the engine (once, first) from the engine's part of the run's resolved config."""

    spec: EngineSpec


@dataclass(frozen=True)
class Generate:
    """A generation batch: each replica generates its contiguous share of the prompts."""

    request: int
    prompt_ids: list[list[int]]
    n: int
    params: SamplingParams


@dataclass(frozen=True)
class Weights:
    """A weight version follows: the worker counts itself done once it has generated every batch
    asked for before it, then waits for ``Stream``."""

    request: int
    version: int | None  # the trainer steps in these weights (None: unchanged)
    bucket_bytes: int = 0  # the stream's bucket size (rollout.weight_sync_bucket_mb), reserved before it


@dataclass(frozen=True)
class Stream:
    """Every worker is ready for weight version ``request``: trainer rank 0 streams it now."""

    request: int


@dataclass(frozen=True)
class Collect:
    """Replica leaders: send ``request``'s rollouts to trainer rank 0 (every engine has it done)."""

    request: int


@dataclass(frozen=True)
class Cancel:
    """Generation batches nobody will collect: aborted if generating, ended at once if queued."""

    requests: tuple[int, ...]
    why: str = "cancelled"  # for the engines' log: "cancelled" (a spent budget), "released at the stop"


@dataclass(frozen=True)
class Stop:
    """The trainers are done: abort what is left and exit."""


Message = Start | Generate | Weights | Stream | Collect | Cancel | Stop


@dataclass(frozen=True)
class Failure:
    """A worker's error, as trainer rank 0 reports it."""

    engine: int  # the engine rank
    kind: str  # the exception's class name
    text: str

    def error(self) -> Exception:
        """The exception trainer rank 0 raises: a ConfigError stays one (one line, exit 2)."""
        if self.kind == "ConfigError":
            return ConfigError(self.text)
        return RuntimeError(f"engine rank {self.engine} failed: {self.kind}: {self.text} "
                            "(its log has the traceback)")


class Progress:
    """Which engine workers are done with each request, and which failed, in the store.

    Counters: ``done/<request>`` (each worker adds 1 as it finishes the request) and ``failed``
    (with the error under ``failure/<engine>``). Trainer rank 0 reads them with ``add(key, 0)``, which
    never waits, so its waits are polls it can cut short (a stop's deadline) and no engine rank
    waits for the trainers' reading. Give each process a store client of its own: on an engine
    rank the worker thread writes while the main thread may sit in a blocking wait on its channel.
    """

    def __init__(self, store: dist.Store, num_engines: int) -> None:
        self.store, self.num_engines = store, num_engines

    def done(self, request: int) -> None:
        """Worker: this engine rank is done with ``request``."""
        self.store.add(f"done/{request}", 1)

    def fail(self, engine: int, error: BaseException) -> None:
        """Worker: this engine rank failed (every wait of trainer rank 0 ends with the error)."""
        self.store.set(f"failure/{engine}", f"{type(error).__name__}\n{error}".encode())
        self.store.add("failed", 1)

    def count(self, request: int) -> int:
        """Trainer rank 0: how many engine ranks are done with ``request``."""
        return self.store.add(f"done/{request}", 0)

    def failures(self) -> list[Failure]:
        """Trainer rank 0: the engine ranks that failed so far, in engine rank order."""
        if not self.store.add("failed", 0):
            return []
        out = []
        for engine in range(self.num_engines):
            key = f"failure/{engine}"
            if self.store.check([key]):
                kind, _, text = self.store.get(key).decode().partition("\n")
                out.append(Failure(engine, kind, text))
        return out

    def forget(self, request: int) -> None:
        """Trainer rank 0: ``request``'s counter is read for the last time."""
        self.store.delete_key(f"done/{request}")
