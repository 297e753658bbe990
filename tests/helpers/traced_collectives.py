"""Which threads drive each process's device communicators, recorded in a real run.

Run as the trainer's command (``python -m tests.helpers.traced_collectives train ...``, also under
torchrun, with ``TRACE_DIR`` set) it wraps, in every process before the CLI starts:

- the weight bytes' group of a separate placement (``WorldSplit.links.transfer``; NCCL on a GPU, so
  a device communicator there; gloo standing in for it here), found by wrapping ``split_world``:
  every operation issued on it, and its shutdown or abort;
- vLLM's device communicators (every method of its ``DeviceCommunicatorBase`` classes that moves
  tensors: the tensor-parallel all-reduces of a forward, and the rest);

(the stalling engines of tests/helpers/stalling_engine.py are registered too, so a traced run may
stall a batch) and at exit writes ``TRACE_DIR/rank<launch rank>.json``: per communicator, the names
of the threads that issued operations on it, their count, and how the transfer group ended
("shutdown", "abort" or null). tests/functional/test_async_rollouts.py and test_async_rollouts_vllm.py
read them. On code where the transfer group is the attribute ``split.transfer`` (before the links
existed) it is found there, so the same tracer shows what that code did.
"""

import atexit
import json
import os
import sys
import threading
from collections import defaultdict
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.rollout.hf_engine import HFEngine

VLLM_METHODS = ("all_reduce", "all_gather", "all_gatherv", "gather", "reduce_scatter", "reduce_scatterv",
                "send", "recv", "broadcast", "send_tensor_dict", "recv_tensor_dict", "all_gather_into_tensor")
GROUP_METHODS = ("broadcast", "allgather", "allreduce", "gather", "send", "recv", "barrier", "scatter")

_threads: dict[str, set[str]] = defaultdict(set)
_calls: dict[str, int] = defaultdict(int)
_transfer: list = []  # this process's transfer group, once split_world made it
_ended: list[str] = []
_launch_rank: list[str] = ["0"]  # RANK at install (an engine rank's worker later sets its engine rank)


def _record(kind: str) -> None:
    _threads[kind].add(threading.current_thread().name)
    _calls[kind] += 1


def _wrap_group_class(cls) -> None:
    for name in GROUP_METHODS + ("shutdown", "abort"):
        original = getattr(cls, name, None)
        if original is None:
            continue

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            if _transfer and self is _transfer[0]:
                if _name in ("shutdown", "abort"):
                    _ended.append(_name)
                    try:
                        return _original(self, *args, **kwargs)
                    finally:  # at once too: torchrun may SIGTERM the rank before its atexit runs
                        _write(_launch_rank[0])
                _record("transfer")
            return _original(self, *args, **kwargs)

        setattr(cls, name, wrapper)


def _wrap_split_world() -> None:
    from megatron_dapo.rollout import worlds

    original = worlds.split_world

    def split_world(*args, **kwargs):
        split = original(*args, **kwargs)
        links = getattr(split, "links", None)
        group = links.transfer if links is not None else getattr(split, "transfer", None)
        if group is not None:
            _transfer.append(group)
        return split

    worlds.split_world = split_world


def _wrap_results() -> None:
    """Rollouts travel by channel.send_object / recv_object (a replica leader to trainer rank 0)."""
    from megatron_dapo.rollout import channel

    for name in ("send_object", "recv_object"):
        original = getattr(channel, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            _calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(channel, name, wrapper)


class FailingHFEngine(HFEngine):
    """``rollout.engine=failing_hf``: the HF engine, failing every weight load (an engine error on
    every engine rank, for the exit paths after a failure)."""

    def update_weights(self, weights):
        raise ValueError("failing_hf refuses every weight load (tests/helpers/traced_collectives.py)")


def _wrap_vllm() -> None:
    try:
        from vllm.distributed.device_communicators import cpu_communicator  # noqa: F401 (its class, loaded)
        from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    except ImportError:
        return
    for cls in [DeviceCommunicatorBase, *_subclasses(DeviceCommunicatorBase)]:
        for name in VLLM_METHODS:
            original = cls.__dict__.get(name)
            if original is None:
                continue

            def wrapper(self, *args, _original=original, **kwargs):
                _record("vllm")
                return _original(self, *args, **kwargs)

            setattr(cls, name, wrapper)


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _write(rank: str) -> None:
    out = Path(os.environ["TRACE_DIR"]) / f"rank{rank}.json"
    out.write_text(json.dumps({"threads": {k: sorted(v) for k, v in _threads.items()}, "calls": dict(_calls),
                               "transfer_ended": _ended[-1] if _ended else None,
                               "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}))


def install() -> None:
    for cls in (dist.ProcessGroupGloo, getattr(dist, "ProcessGroupNCCL", None)):
        if cls is not None:
            _wrap_group_class(cls)
    _wrap_split_world()
    _wrap_results()
    _wrap_vllm()
    from megatron_dapo.rollout.engine import ENGINES

    if "failing_hf" not in ENGINES:
        ENGINES.register("failing_hf")("tests.helpers.traced_collectives:FailingHFEngine")
    # the launch rank now: an engine rank's worker sets RANK to its rank among the engines (vLLM reads it)
    _launch_rank[0] = os.environ.get("RANK", "0")
    atexit.register(_write, _launch_rank[0])


if __name__ == "__main__":
    from tests.helpers import stalling_engine

    stalling_engine.register()  # a traced run may stall a batch too (rollout.engine=stalling_hf)
    install()
    from megatron_dapo.cli import main

    sys.exit(main())
