"""Which process this is: the one lookup of the rank, world size and local rank.

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
