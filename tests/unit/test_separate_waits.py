"""Trainer rank 0's waits for the engines (rollout/separate.py ``SeparatePlacement``): polls of the
progress counters in a real store, written by threads that stand for the engine ranks' workers
(rollout/protocol.Progress, as the workers write them). A wait ends when every engine is done, when
the caller's deadline passes (the count of batches finished by then), with an engine's failure (a
ConfigError stays one line), or after rollout.wait_timeout_minutes; no wait is a collective, so
none depends on a process group's timeout. The trainers' and engines' whole protocol runs under
torchrun in tests/functional/test_async_rollouts.py."""

import threading
import time

import pytest
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.channel import Channel, WaitTimeout
from megatron_dapo.rollout.protocol import Progress
from megatron_dapo.rollout.separate import Engines, SeparatePlacement
from megatron_dapo.rollout.worlds import EngineLinks, WorldSplit

ENGINES = 2


def _placement(wait_s: float = 60.0) -> tuple[SeparatePlacement, Progress]:
    """Trainer rank 0 of a world of one trainer and two engine ranks; its store is the engines' too."""
    progress = Progress(dist.HashStore(), ENGINES)
    control = Channel(None, None, wait_s=wait_s, waits_for="trainer rank 0")  # its waits are not used here
    links = EngineLinks(control=control, progress=progress, stream=None, transfer=None, member=0, device=None)
    split = WorldSplit(is_trainer=True, rank=0, world_size=1 + ENGINES, num_trainers=1, num_engines=ENGINES,
                       links=links, wait_s=wait_s)
    return SeparatePlacement(Engines(split)), progress


def _later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_a_wait_ends_when_the_last_engine_is_done_and_counts_as_waited():
    placement, progress = _placement()
    progress.done(1)
    _later(0.3, lambda: progress.done(1)).join(0)
    started = time.monotonic()
    assert placement.wait_for([1]) == 1
    assert 0.25 < time.monotonic() - started < 2.0
    assert 0.25 < placement.take_waits()["timing_s/trainer_waited"] < 2.0


def test_a_deadline_counts_the_batches_finished_by_then():
    placement, progress = _placement()
    for _ in range(ENGINES):
        progress.done(7)  # step 2's batch: done; step 3's (request 8): one engine of two
    progress.done(8)
    deadline = time.monotonic() + 0.3
    assert placement.wait_for([7, 8], until=lambda: deadline) == 1
    assert time.monotonic() >= deadline
    # a deadline read at every poll: a stop that comes during the wait cuts it short
    stop_at: list[float] = []
    _later(0.2, lambda: stop_at.append(time.monotonic()))
    assert placement.wait_for([8], until=lambda: stop_at[0] if stop_at else None) == 0


def test_an_engine_failure_ends_the_wait_with_its_error():
    placement, progress = _placement()
    _later(0.1, lambda: progress.fail(1, ConfigError("rollout.gpu_memory_utilization=0.9 asks for more")))
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization=0.9 asks for more$"):
        placement.wait_for([3])
    placement, progress = _placement()
    progress.fail(0, ValueError("shape mismatch"))
    with pytest.raises(RuntimeError, match="engine rank 0 failed: ValueError: shape mismatch"):
        placement.wait_for([3])


def test_a_wait_past_the_timeout_names_the_key_and_the_engines_missing():
    placement, progress = _placement(wait_s=0.2)
    progress.done(5)
    with pytest.raises(WaitTimeout, match=r"request 5: 1 of 2 engine ranks have not finished it "
                                          r"\(rollout.wait_timeout_minutes"):
        placement.wait_for([5])
    # one limit for a whole wait_for (the other trainer ranks wait for its answer once): three
    # requests done one after another, 0.15 s apart, outlast 0.2 s together though each is quicker
    placement, progress = _placement(wait_s=0.2)
    for request in (6, 7, 8):
        _later(0.15 * (request - 5), lambda request=request: [progress.done(request) for _ in range(ENGINES)])
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="request 7"):  # a limit per request would never fire
        placement.wait_for([6, 7, 8])
    assert time.monotonic() - started < 2.0
