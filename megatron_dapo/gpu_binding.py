"""One GPU a rank: which GPU this process takes, and a launch that gives two ranks one GPU refused.

NCCL refuses a communicator in which two ranks share a GPU ("Duplicate GPU detected", NCCL 2.28.9
on an H200, docs/gpu.md), but only at the group's first collective: after the model is built and
the base weights are read, and inside a traceback that a teardown's own collective can hide. Both
ways a launch gets there are checked here, before any process group starts:

- more processes on a node than it shows GPUs (``torchrun --nproc-per-node`` too large, or
  ``CUDA_VISIBLE_DEVICES`` too short): ``bind_gpu``;
- ranks that see the same GPU under different indices (a hand-made launch, a per-task
  ``CUDA_VISIBLE_DEVICES``): ``check_distinct_gpus``, over the launch's rendezvous store.
"""

from __future__ import annotations

import os
import socket

from megatron_dapo import ranks
from megatron_dapo.errors import ConfigError


def bind_gpu() -> int:
    """Makes cuda:LOCAL_RANK this process's device and returns its index; a ConfigError naming
    LOCAL_RANK, the GPUs this process sees and the fix when there is no such GPU."""
    import torch

    local, count = ranks.local_rank(), torch.cuda.device_count()
    if local >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"{count} GPU{'s' if count != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
        raise ConfigError(f"LOCAL_RANK={local}, but this process sees {seen}: NCCL needs a GPU of its own for each "
                          f"rank; start at most {count} process{'es' if count != 1 else ''} a node "
                          f"(torchrun --nproc-per-node={count})")
    torch.cuda.set_device(local)
    return local


def gpu_identity() -> str:
    """This process's current GPU, the same string on every process that uses it: host and UUID."""
    import torch

    return f"{socket.gethostname()} GPU {torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def first_shared_gpu(identities: list[str]) -> tuple[int, int, str] | None:
    """(first rank, second rank, the GPU) of the first two ranks in ``identities`` (one per rank,
    in rank order) that hold the same GPU; None when each holds its own."""
    seen: dict[str, int] = {}
    for rank, identity in enumerate(identities):
        if identity in seen:
            return seen[identity], rank, identity
        seen[identity] = rank
    return None


def check_distinct_gpus(store, rank: int, world_size: int, identity: str) -> None:
    """Collective over the launch (every rank calls it once, with its ``identity``): a ConfigError on
    every rank when two ranks hold one GPU. ``store``: the launch's rendezvous store, before any
    process group starts; the keys carry torchrun's restart count, so a restarted launch does not
    read its previous attempt's."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store.set(f"gpu_binding/{attempt}/{rank}", identity)
    identities = [store.get(f"gpu_binding/{attempt}/{r}").decode() for r in range(world_size)]
    shared = first_shared_gpu(identities)
    if shared is not None:
        first, second, gpu = shared
        raise ConfigError(f"ranks {first} and {second} of this launch hold the same GPU ({gpu}): NCCL needs a GPU "
                          "of its own for each rank; give every process its own (one per GPU a node, "
                          "LOCAL_RANK from the launcher, CUDA_VISIBLE_DEVICES unset or listing every GPU)")
