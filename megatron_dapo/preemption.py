"""Graceful stop: SIGTERM (SLURM preemption, ``scancel``, torchrun's shutdown), SIGUSR1 (SLURM's
``--signal=B:USR1@<seconds>``) and SIGINT (Ctrl-C) ask the trainer to stop at the next step boundary.

The first signal only sets a flag and prints one line. The loop finishes the step it is in (a step
that has started updating the weights cannot be abandoned without losing its updates), then all
ranks agree to stop (one all-reduce of the flag per step, so ranks that got the signal at different
moments stop after the same step), save a checkpoint and exit 0 with one line naming it. A second
signal (more than FORWARD_WINDOW_S after the first) exits at once without a checkpoint (exit code
128 + signal): the last saved checkpoint stays intact, since saves are atomic (policy/checkpoint.py).

So the grace period must exceed one step: SLURM's ``--signal`` lead time (recipes) or torchrun's
30 s between its SIGTERM and SIGKILL. The time from the signal to the saved checkpoint is printed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A second signal this soon after the first is the same request: Ctrl-C under torchrun reaches each
# worker directly (SIGINT, from the terminal) and again through the agent (SIGTERM), milliseconds apart.
FORWARD_WINDOW_S = 2.0


class StopRequest:
    """Installs the handlers (main thread only; elsewhere it stays inert) and keeps the request."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None and time.monotonic() - self.received_at < FORWARD_WINDOW_S:
            return  # the same request again: Ctrl-C reaches torchrun's workers directly and forwarded
        if self.signum is not None:
            print(f"megatron-dapo: second {name}: exiting now without saving; rerun to resume from the "
                  "last checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        if _rank() == 0:
            print(f"megatron-dapo: {name} received: finishing this step, then saving a checkpoint "
                  f"(send {name} again to exit at once)", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True on every rank iff any rank got a signal; collective when torch.distributed is up."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signum is not None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([0 if self.signum is None else self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self.signum is None and flag.item():
            self.signum, self.received_at = int(flag.item()), time.monotonic()
        return bool(flag.item())

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # not imported yet: not initialised either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
