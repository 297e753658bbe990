"""Which process this is: the one lookup of the rank, world size and local rank, and the one small
agreement every rank of the default group reaches (``max_over_ranks``).

torch.distributed's answer once a process group exists; before that (set-up, a run that ends
before building anything, the CLI's last line) the launcher's variables (torchrun and our SLURM
launcher set RANK, WORLD_SIZE and LOCAL_RANK); a plain ``python`` process is rank 0 of 1.
"""

from __future__ import annotations

import os
import sys


def _group():
    dist = sys.modules.get("torch.distributed")  # not imported yet: not initialised either
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _group()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    dist = _group()
    return dist.get_world_size() if dist is not None else int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched() -> bool:
    """Whether a launcher (torchrun, srun's torchrun) started this process: then it has a
    rendezvous address to join."""
    return "RANK" in os.environ


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of the default group's ranks (collective: one all-reduce of an int, on
    the device the group's backend reduces on); ``value`` itself when no process group is up."""
    dist = _group()
    if dist is None:
        return value
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())
