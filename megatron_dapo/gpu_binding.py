"""One GPU a rank: which GPU this process takes, and a launch that cannot give each rank its own refused.

NCCL refuses a communicator in which two ranks share a GPU ("Duplicate GPU detected", docs/gpu.md),
but only at the group's first collective: after the model is built and the base weights are read,
and inside a traceback that a teardown's own collective can hide. A launch gets there in two ways,
both found here before NCCL's first collective:

- more processes on a node than it shows GPUs (``torchrun --nproc-per-node`` too large, or
  ``CUDA_VISIBLE_DEVICES`` too short): ``bind_gpu`` records the refusal instead of a device;
- ranks that see one GPU under different indices (a hand-made launch, a per-task
  ``CUDA_VISIBLE_DEVICES``): their UUIDs are equal.

Each rank binds, the launch gathers every rank's ``Binding`` over gloo (the caller's group), and
``check_bindings`` raises the same one-line ConfigError on every rank, so none is left waiting
for a peer that has already exited.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from megatron_dapo import ranks
from megatron_dapo.errors import ConfigError


@dataclass(frozen=True)
class Binding:
    """One rank's GPU: ``gpu``, its UUID (unique across machines), or ``refusal``, why it has
    none; ``host`` names the machine in messages."""

    host: str
    gpu: str | None = None
    refusal: str | None = None


def bind_gpu() -> Binding:
    """Makes cuda:LOCAL_RANK this process's device when there is one; the refusal names LOCAL_RANK,
    the GPUs this process sees and the fix when there is none."""
    import torch

    host, local, count = socket.gethostname(), ranks.local_rank(), torch.cuda.device_count()
    if local >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"{count} GPU{'s' if count != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
        return Binding(host, refusal=f"LOCAL_RANK={local}, but this process sees {seen} on {host}: NCCL needs a GPU "
                                     f"of its own for each rank; start at most {count} "
                                     f"process{'es' if count != 1 else ''} a node (torchrun --nproc-per-node={count})")
    torch.cuda.set_device(local)
    return Binding(host, gpu=str(torch.cuda.get_device_properties(local).uuid))


def first_shared_gpu(gpus: list[str | None]) -> tuple[int, int] | None:
    """(first rank, second rank) of the first two ranks in ``gpus`` (one UUID per rank, in rank
    order; None: no GPU) that hold the same GPU; None when each holds its own."""
    seen: dict[str, int] = {}
    for rank, gpu in enumerate(gpus):
        if gpu is not None and gpu in seen:
            return seen[gpu], rank
        if gpu is not None:
            seen[gpu] = rank
    return None


def check_bindings(bindings: list[Binding]) -> None:
    """Every rank's binding, in rank order: the same ConfigError on every rank when one rank has no
    GPU of its own or two ranks hold one."""
    for rank, binding in enumerate(bindings):
        if binding.refusal is not None:
            raise ConfigError(f"rank {rank}: {binding.refusal}")
    shared = first_shared_gpu([b.gpu for b in bindings])
    if shared is not None:
        first, second = shared
        raise ConfigError(f"ranks {first} and {second} of this launch hold the same GPU (GPU {bindings[first].gpu} "
                          f"on {bindings[first].host}): NCCL needs a GPU of its own for each rank; give every process "
                          "its own (one per GPU a node, LOCAL_RANK from the launcher, CUDA_VISIBLE_DEVICES unset or "
                          "listing every GPU)")
