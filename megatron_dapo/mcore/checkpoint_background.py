"""A checkpoint's tensors written by a child process while training goes on (``checkpoint.async_save``).

megatron-core's dist checkpointing splits a save into a plan (collective, in the trainer), a write
(the bytes; no collective) and a finalize (collective: the global metadata on rank 0). With
``async_sharded_save`` it hands the write back as an ``AsyncRequest``; this module runs it:

* ``start``: the request's preload (device tensors copied to host memory: with the plan, the part of
  the write that blocks training on a GPU), then a forked child writes the files. What it writes is
  the state at the save: device tensors are those host copies, host tensors that are views (the DDP
  parameter buffers on a CPU) megatron's plan cloned, and the rest the child sees as of the fork
  (its memory is a copy-on-write snapshot of the trainer's).
* ``all_done`` (collective): whether every rank's child has exited; a step asks before it starts.
* ``finish`` (collective): the child joined, its write results handed to megatron's finalize, the
  metadata written. Only then may the checkpoint be published (checkpoint.publish_checkpoint).

Why not megatron's ``AsyncCallsQueue``: its forked child hands results back through a queue from a
``multiprocessing.Manager`` (a server process) and outlives a killed trainer, and its completion
check reduces a CUDA tensor. Here the child leaves its results in a file, dies with the trainer
(PR_SET_PDEATHSIG: a SIGKILLed trainer leaves no writer behind to write into the directory its
resumed run reuses), and the completion check is one all-reduce on the group's own device.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_dapo import ranks

_PR_SET_PDEATHSIG = 1


@dataclass
class BackgroundWrite:
    """One rank's part of a checkpoint being written by its child process."""

    request: object  # megatron's AsyncRequest: the write and its finalize functions
    results: Path  # where the child leaves its write results (pickled), in the checkpoint's directory
    process: mp.Process | None = None  # None: this rank writes nothing (or the write is finished)
    staged_s: float = 0.0  # seconds the trainer spent copying device tensors to the host and forking
    write_s: float = 0.0  # seconds the child wrote (set by finish)
    waited_s: float = 0.0  # seconds finish waited for the child


def start(request, tmp: Path) -> BackgroundWrite:
    """Stages the request's tensors on the host and forks the child that writes them into ``tmp``."""
    began = time.monotonic()
    results = tmp / f".write_results.rank{dist.get_rank():05d}"  # read and removed before the publish
    write = BackgroundWrite(request=request, results=results)
    if request.async_fn is not None:
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()  # device -> host copies, synchronised
        write.process = mp.get_context("fork").Process(
            target=_write_in_child, args=(request.async_fn, args, request.async_fn_kwargs, results),
            name="megatron-dapo checkpoint writer", daemon=True)
        write.process.start()
    write.staged_s = time.monotonic() - began
    return write


def _write_in_child(write_fn, args: list, kwargs: dict, results: Path) -> None:
    """The child: megatron's write with a queue of its own (the trainer's stays untouched), its
    results pickled into ``results`` (written aside, then renamed: a file there is whole)."""
    # No collection in the child: a cycle holding a device tensor would be freed from a process that
    # must not touch the device (megatron's writer disables it for its own part too).
    gc.disable()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the trainer died before the prctl
        os._exit(1)
    own, began = queue.Queue(), time.monotonic()
    args[2] = own
    try:
        write_fn(*args, **kwargs)
        outcome = own.get_nowait()
    except Exception as e:  # noqa: BLE001 - handed to the trainer, which raises it in finalize
        outcome = RuntimeError(f"checkpoint writer: {type(e).__name__}: {e}")
    aside = results.with_name(results.name + ".part")  # one per rank
    with open(aside, "wb") as f:
        pickle.dump((outcome, time.monotonic() - began), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, results)


def all_done(write: BackgroundWrite) -> bool:
    """Whether every rank's child has exited (collective: one small all-reduce)."""
    return ranks.max_over_ranks(int(write.process is not None and write.process.is_alive())) == 0


def finish(write: BackgroundWrite, writer_queue) -> None:
    """Waits for this rank's child, hands its results to megatron's writer (``writer_queue``, the
    queue the writer reads them from) and runs the finalize functions (collective: the metadata).
    Raises when a child failed, on every rank."""
    began = time.monotonic()
    if write.process is not None:
        write.process.join()
        code, write.process = write.process.exitcode, None
        if write.results.is_file():
            with open(write.results, "rb") as f:
                outcome, write.write_s = pickle.load(f)
            writer_queue.put(outcome)
            write.results.unlink()
        else:
            writer_queue.put(RuntimeError(f"checkpoint writer exited with {code} and left no results"))
    write.waited_s = time.monotonic() - began
    for finalize in write.request.finalize_fns:  # megatron raises there on every rank when one failed
        finalize()
