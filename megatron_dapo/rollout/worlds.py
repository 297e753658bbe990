"""Separate placement's process groups and weight stream (issue 22, item 1; used by rollout/separate.py).

With ``rollout.placement=separate`` the last ``rollout.num_ranks`` ranks of a launch hold only
engines. Megatron must not see them: its groups are made over the default process group's world.
So each side gets a default world of its own, cut out of the launch's one rendezvous store by a
key prefix::

    launch ranks   0   1   2   3            rollout.num_ranks = 2
    default world  [train 0, 1] [engine 0, 1]     megatron's TP/PP/DP groups live in the first
    transfer       0 ----------> 2, 3             trainer rank 0 and every engine rank

The transfer group is built by hand (gloo on CPU, NCCL on GPU) over its members only; the other
trainer ranks never touch it. Weights travel on it as the colocated sync's stream: every trainer
rank runs the export (its gathers are collectives of the training world), trainer rank 0
broadcasts each bucket of (HF name, full tensor) pairs, and every engine rank hands it to the same
``engine.update_weights`` a colocated sync uses, then ``finish_weight_update``. A bucket travels as
a small header (names, shapes, dtypes, pickled: its size, then its bytes) and one flat byte
tensor, so a step's sync is three broadcasts a bucket whatever the number of tensors in it.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo import ranks
from megatron_dapo.errors import ConfigError
from megatron_dapo.gpu_binding import bind_gpu, check_bindings
from megatron_dapo.rollout.weight_sync import bucketed, count_bucket, finish_update, new_counts

_END = "end"  # the header that closes a weight stream


@dataclass(frozen=True)
class WorldSplit:
    """This process's side of a separate-placement launch.

    ``rank``/``world_size``: in the launch; ``side_rank``: in this side's default world;
    ``transfer``: the weight group (trainer rank 0 is its rank 0, engine rank i its rank i + 1),
    None on the trainer ranks that are not in it; ``device``: where its tensors must be (NCCL's on
    this process's GPU)."""

    is_trainer: bool
    rank: int
    world_size: int
    num_trainers: int
    num_engines: int
    transfer: object | None
    device: torch.device = torch.device("cpu")

    @property
    def side_rank(self) -> int:
        return self.rank if self.is_trainer else self.rank - self.num_trainers


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


def sides(rollout, world_size: int) -> tuple[int, int]:
    """(trainer ranks, engine ranks) of a launch of ``world_size`` under ``rollout`` (a
    config.RolloutConfig): colocated, every rank is both; separate, ``check_split``'s split (its
    ConfigError when the split cannot run)."""
    if rollout.placement != "separate":
        return world_size, world_size
    trainers = check_split(world_size, rollout.num_ranks, rollout.tensor_parallel_size)
    return trainers, rollout.num_ranks


def split_world(num_engine_ranks: int, *, tensor_parallel_size: int = 1, backend: str | None = None,
                timeout_minutes: int = 30) -> WorldSplit:
    """Start this process's default world (its side's ranks) and, on its members, the transfer
    group, from the launcher's rendezvous (env://: torchrun's or our SLURM launcher's variables).
    Collective over the whole launch: every rank calls it once, before anything else starts
    torch.distributed."""
    if dist.is_initialized():
        raise RuntimeError("split_world must start torch.distributed itself (it is already initialised)")
    check_split(ranks.world_size(), num_engine_ranks, tensor_parallel_size)  # before any rendezvous
    store, rank, world_size = next(dist.rendezvous("env://"))
    num_trainers = check_split(world_size, num_engine_ranks, tensor_parallel_size)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store.set_timeout(timeout)
    if backend == "nccl":  # as initialize_parallel does for a world it starts: one GPU a rank, checked first
        binding = bind_gpu()
        launch = dist.ProcessGroupGloo(dist.PrefixStore("gpu_binding/", store), rank, world_size, timeout)
        check_bindings(gather_objects(launch, world_size, torch.device("cpu"), binding))
    is_trainer = rank < num_trainers
    side = "trainers" if is_trainer else "engines"
    dist.init_process_group(backend, store=dist.PrefixStore(f"{side}/", store),
                            rank=rank if is_trainer else rank - num_trainers,
                            world_size=num_trainers if is_trainer else num_engine_ranks, timeout=timeout)
    transfer = None
    if rank == 0 or not is_trainer:  # trainer rank 0 and the engines; the rest never build it
        members = 1 + num_engine_ranks
        group_rank = 0 if rank == 0 else rank - num_trainers + 1
        prefix = dist.PrefixStore("transfer/", store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # the same limit as the worlds' (NCCL's own default is shorter)
            transfer = dist.ProcessGroupNCCL(prefix, group_rank, members, options)
        else:
            transfer = dist.ProcessGroupGloo(prefix, group_rank, members, timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return WorldSplit(is_trainer, rank, world_size, num_trainers, num_engine_ranks, transfer, device)


def _broadcast(split: WorldSplit, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every member of the transfer group (on split.device), returned."""
    tensor = tensor.to(split.device)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    split.transfer.broadcast([tensor], opts).wait()
    return tensor


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor):
    return pickle.loads(data.cpu().numpy().tobytes())


def broadcast_object(split: WorldSplit, obj=None) -> object:
    """Rank 0's ``obj`` on every member (pickled: a length, then the bytes)."""
    data = _pickled(obj) if split.rank == 0 else None
    size = _broadcast(split, torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64))
    return _unpickled(_broadcast(split, data if data is not None else torch.empty(int(size), dtype=torch.uint8)))


def allgather_objects(split: WorldSplit, obj) -> list:
    """Every transfer-group member's ``obj``, in group rank order (trainer rank 0 first)."""
    return gather_objects(split.transfer, 1 + split.num_engines, split.device, obj)


def gather_objects(group, members: int, device: torch.device, obj) -> list:
    """Every member's ``obj`` over ``group`` (a process group object of ``members`` ranks, its
    tensors on ``device``), in its rank order: the lengths, then the bytes padded to the longest."""
    data = _pickled(obj).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(members)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    group.allgather([sizes], [mine]).wait()
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(members)]
    group.allgather([parts], [padded]).wait()
    return [_unpickled(p[:int(s.item())]) for p, s in zip(parts, sizes)]


Header = list[tuple[str, tuple[int, ...], torch.dtype]]


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[Header, torch.Tensor]:
    """A bucket as (names, shapes and dtypes; [total bytes] uint8: the tensors' bytes in order)."""
    header = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    flat = (torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket]) if bucket
            else torch.empty(0, dtype=torch.uint8))
    return header, flat


def _sizes(header: Header) -> tuple[list[int], list[int]]:
    """(each tensor's element size, its bytes)."""
    items = [torch.empty((), dtype=dtype).element_size() for _, _, dtype in header]
    return items, [torch.Size(shape).numel() * item for (_, shape, _), item in zip(header, items)]


def unpack(header: Header, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``pack``'s inverse: views into ``flat`` where aligned (a piece after a narrower dtype may
    start off its own alignment, and is copied then)."""
    items, sizes = _sizes(header)
    pieces = [p if p.storage_offset() % item == 0 else p.clone()
              for p, item in zip(torch.split(flat, sizes), items)]
    return [(name, piece.view(dtype).view(shape)) for (name, shape, dtype), piece in zip(header, pieces)]


def send_weights(split: WorldSplit, weights: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> dict[str, int]:
    """Trainer side: every trainer rank consumes ``weights`` (the export's collectives), rank 0
    broadcasts each bucket to the engines. Returns the counts sync_weights returns."""
    stats = new_counts()
    for bucket in bucketed(weights, bucket_bytes):
        count_bucket(stats, bucket)
        if split.transfer is None:
            continue
        header, flat = pack(bucket)
        broadcast_object(split, header)
        _broadcast(split, flat)
    if split.transfer is not None:
        broadcast_object(split, _END)
    return stats


def receive_weights(split: WorldSplit, engine) -> dict[str, int]:
    """Engine side: the buckets of one ``send_weights``, each into ``engine.update_weights`` as
    it arrives, then ``engine.finish_weight_update()``. Returns the same counts."""
    stats = new_counts()
    while (header := broadcast_object(split)) != _END:
        if isinstance(header, tuple):  # a request instead of a bucket: the trainers gave up mid-stream
            raise RuntimeError(f"engine rank {split.side_rank}: the trainers sent {header[0]!r} in the middle "
                               "of a weight stream (a trainer failed while exporting; its own error says why)")
        flat = _broadcast(split, torch.empty(sum(_sizes(header)[1]), dtype=torch.uint8, device=split.device))
        bucket = unpack(header, flat)
        engine.update_weights(bucket)
        count_bucket(stats, bucket)
    finish_update(engine)
    return stats
