"""Separate placement's process groups: a default world for each side, and the links between them.

With ``rollout.placement=separate`` the last ``rollout.num_ranks`` ranks of a launch hold only
engines. Megatron must not see them: its groups are made over the default process group's world.
So each side gets a default world of its own, cut out of the launch's one rendezvous store by a
key prefix, and trainer rank 0 and the engine ranks share links of their own::

    launch ranks   0   1   2   3            rollout.num_ranks = 2
    default world  [train 0, 1] [engine 0, 1]     megatron's TP/PP/DP groups live in the first
    links          0 ----------> 2, 3             trainer rank 0 and every engine rank
    trainers       0 ----> 1                      rank 0's answers to the other trainer ranks

Who uses what, and from which thread (an engine rank runs two: rollout/engine_server.py):

| link | what travels | trainer rank 0 | engine rank |
|---|---|---|---|
| ``control``: store doorbell + gloo (channel.py) | requests; rollouts back | main | main |
| ``progress``: store counters (protocol.py) | done / failed per request | main, reads | worker, writes |
| ``stream``: gloo | weight bucket headers | main | worker |
| ``transfer``: NCCL on GPU, gloo on CPU | weight bucket bytes | main | worker |

So on an engine rank one thread, the worker, issues every operation on its device (vLLM's own
collectives and the weight bytes): NCCL does not allow two threads to drive communicators of one
device at once, and with the launcher's ``CUDA_DEVICE_MAX_CONNECTIONS=1`` the two would share one
hardware queue and could wait on each other in a cycle. No collective here waits for the other side's
work: the control channel's receivers wait in the store, and trainer rank 0 polls the progress
counters; a collective starts only when every member is known to be at it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo import ranks
from megatron_dapo.errors import ConfigError
from megatron_dapo.gpu_binding import bind_gpu, check_bindings
from megatron_dapo.rollout.channel import Channel, gather_objects
from megatron_dapo.rollout.protocol import Progress


@dataclass(frozen=True)
class EngineLinks:
    """Trainer rank 0's and the engine ranks' links (module doc's table). ``member``: this process's
    rank among them (trainer rank 0 is 0, engine rank i is i + 1)."""

    control: Channel
    progress: Progress
    stream: object  # a ProcessGroupGloo
    transfer: object  # a ProcessGroupNCCL on GPU, a ProcessGroupGloo on CPU
    member: int
    device: torch.device  # where the transfer group's tensors are

    def close(self, *, failed: bool) -> None:
        """Shuts every group down, or aborts it after a failure (a peer may be gone: a clean
        shutdown of NCCL's communicators could wait for it). A gloo group's abort frees nothing a
        peer waits on (torch 2.13): peers are freed by this process's exit, or by a channel closed
        first (rollout/channel.py)."""
        _close([self.control.group, self.stream, self.transfer], failed=failed)


@dataclass(frozen=True)
class WorldSplit:
    """This process's side of a separate-placement launch.

    ``rank``/``world_size``: in the launch; ``side_rank``: in this side's default world; ``links``:
    trainer rank 0's and the engines' (None on the other trainer ranks); ``trainers``: rank 0's
    channel to the other trainer ranks (None on engine ranks and in a world of one trainer);
    ``device``: this process's (cuda:LOCAL_RANK with NCCL); ``wait_s``: how long trainer rank 0
    waits for the engines (rollout.wait_timeout_minutes; the channels' receivers wait twice that);
    ``cuts``: a store client of the trainers' own where any trainer rank asks rank 0 to cut the
    step's generation short (rollout/separate.py ``CutRequests``; None where no other trainer rank
    could ask: on engine ranks and in a world of one trainer)."""

    is_trainer: bool
    rank: int
    world_size: int
    num_trainers: int
    num_engines: int
    links: EngineLinks | None = None
    trainers: Channel | None = None
    device: torch.device = torch.device("cpu")
    wait_s: float = 240 * 60.0
    cuts: dist.Store | None = None

    @property
    def side_rank(self) -> int:
        return self.rank if self.is_trainer else self.rank - self.num_trainers

    def close(self, *, failed: bool = False) -> None:
        """Every group this process made besides its default world (the CLI tears that one down)."""
        if self.links is not None:
            self.links.close(failed=failed)
        if self.trainers is not None:
            _close([self.trainers.group], failed=failed)


def _close(groups: list, *, failed: bool) -> None:
    for group in groups:
        try:
            group.abort() if failed else group.shutdown()
        except Exception:  # noqa: BLE001 -- an exit path: the error that brought us here matters more
            pass


def check_split(world_size: int, num_engine_ranks: int, tensor_parallel_size: int) -> int:
    """The number of trainer ranks; a ConfigError naming the keys when the split cannot run."""
    if world_size < 2:
        raise ConfigError(f"rollout.placement=separate needs at least 2 ranks, this launch has {world_size}: "
                          "start it under torchrun (--nproc-per-node) or srun, or use rollout.placement=colocated")
    if num_engine_ranks < 1 or num_engine_ranks >= world_size:
        raise ConfigError(f"rollout.num_ranks={num_engine_ranks} with {world_size} ranks leaves "
                          f"{world_size - num_engine_ranks} to train; give the engines 1 to "
                          f"{world_size - 1} ranks")
    if num_engine_ranks % tensor_parallel_size:
        raise ConfigError(f"rollout.num_ranks={num_engine_ranks} is not a multiple of "
                          f"rollout.tensor_parallel_size={tensor_parallel_size}: every engine replica needs "
                          f"{tensor_parallel_size} ranks")
    return world_size - num_engine_ranks


def rank_counts(rollout, world_size: int) -> tuple[int, int]:
    """(trainer ranks, engine ranks) of a launch of ``world_size`` under ``rollout`` (a
    config.RolloutConfig): colocated, every rank is both; separate, ``check_split``'s split (its
    ConfigError when the split cannot run)."""
    if rollout.placement != "separate":
        return world_size, world_size
    trainers = check_split(world_size, rollout.num_ranks, rollout.tensor_parallel_size)
    return trainers, rollout.num_ranks


def split_world(num_engine_ranks: int, *, tensor_parallel_size: int = 1, backend: str | None = None,
                timeout_minutes: float = 30.0, wait_minutes: float = 240.0) -> WorldSplit:
    """Start this process's default world (its side's ranks) and its links, from the launcher's
    rendezvous (env://: torchrun's or our SLURM launcher's variables). Collective over the whole
    launch: every rank calls it once, before anything else starts torch.distributed.

    ``timeout_minutes``: every process group's (how long one collective may wait: parallel.timeout_minutes);
    ``wait_minutes``: how long a rank waits for the other side's work (rollout.wait_timeout_minutes)."""
    if dist.is_initialized():
        raise RuntimeError("split_world must start torch.distributed itself (it is already initialised)")
    check_split(ranks.world_size(), num_engine_ranks, tensor_parallel_size)  # before any rendezvous
    store, rank, world_size = next(dist.rendezvous("env://"))
    num_trainers = check_split(world_size, num_engine_ranks, tensor_parallel_size)
    is_trainer = rank < num_trainers
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store.set_timeout(timeout)
    device = torch.device("cpu")
    if not is_trainer:
        # Megatron orders its communication behind compute on one hardware queue (the launcher sets
        # it for every rank); an engine's generation and weight stream do not want that. Read when
        # the CUDA context is made: before the bind below.
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if backend == "nccl":  # as initialize_parallel does for a world it starts: one GPU a rank, checked first
        binding = bind_gpu()
        launch = dist.ProcessGroupGloo(dist.PrefixStore("gpu_binding/", store), rank, world_size, timeout)
        check_bindings(gather_objects(launch, world_size, torch.device("cpu"), binding))
        device = torch.device("cuda", ranks.local_rank())
    side = "trainers" if is_trainer else "engines"
    side_rank = rank if is_trainer else rank - num_trainers
    dist.init_process_group(backend, store=dist.PrefixStore(f"{side}/", store), rank=side_rank,
                            world_size=num_trainers if is_trainer else num_engine_ranks, timeout=timeout)
    wait_s = wait_minutes * 60
    receive_s = 2 * wait_s  # a receiver outlasts the sender's waits, which give up with the better message

    def gloo(name: str, member: int, members: int):
        return dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), member, members, timeout)

    def own(name: str):  # a store client of its own (a blocking wait holds its client)
        return dist.PrefixStore(f"{name}/", store.clone())

    trainers = cuts = None
    if is_trainer and num_trainers > 1:
        trainers = Channel(own("trainers_channel"), gloo("trainers_gloo", rank, num_trainers),
                           wait_s=receive_s, waits_for="trainer rank 0")
        cuts = own("trainers_cuts")  # written by a stop's watchdog thread, read by rank 0's polls
    links = None
    if rank == 0 or not is_trainer:  # trainer rank 0 and the engines; the other trainers never build them
        members, member = 1 + num_engine_ranks, 0 if rank == 0 else side_rank + 1
        control = Channel(own("control_channel"), gloo("control", member, members), wait_s=receive_s,
                          waits_for="trainer rank 0")
        stream = gloo("stream", member, members)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # the same limit as the worlds' (NCCL's own default is shorter)
            transfer = dist.ProcessGroupNCCL(dist.PrefixStore("transfer/", store), member, members, options)
        else:
            transfer = gloo("transfer", member, members)
        progress = Progress(own("progress"), num_engine_ranks)
        links = EngineLinks(control, progress, stream, transfer, member, device)
    return WorldSplit(is_trainer, rank, world_size, num_trainers, num_engine_ranks, links, trainers, device,
                      wait_s, cuts)
