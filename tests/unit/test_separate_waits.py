"""Trainer rank 0's waits for the engines (rollout/separate.py ``SeparatePlacement``): polls of the
progress counters in a real store, written by threads that stand for the engine ranks' workers
(rollout/protocol.Progress, as the workers write them). A wait ends when every engine is done, when
the caller's deadline passes (the count of batches finished by then), with an engine's failure (a
ConfigError stays one line), or after rollout.wait_timeout_minutes; no wait is a collective, so
none depends on a process group's timeout. The trainers' and engines' whole protocol runs under
torchrun in tests/functional/test_async_rollouts.py."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.channel import Channel, WaitTimeout, send_object
from megatron_dapo.rollout.engine import GenerationAborted, SamplingParams
from megatron_dapo.rollout.protocol import Collect, Generate, Progress
from megatron_dapo.rollout.separate import RemoteEngines, SeparatePlacement
from megatron_dapo.rollout.worlds import EngineLinks, WorldSplit

ENGINES = 2


def _placement(wait_s: float = 60.0) -> tuple[SeparatePlacement, Progress]:
    """Trainer rank 0 of a world of one trainer and two engine ranks; its store is the engines' too."""
    progress = Progress(dist.HashStore(), ENGINES)
    control = Channel(None, None, wait_s=wait_s, waits_for="trainer rank 0")  # its waits are not used here
    links = EngineLinks(control=control, progress=progress, stream=None, transfer=None, member=0, device=None)
    split = WorldSplit(is_trainer=True, rank=0, world_size=1 + ENGINES, num_trainers=1, num_engines=ENGINES,
                       links=links, wait_s=wait_s)
    return SeparatePlacement(RemoteEngines(split)), progress


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


def _linked(stalls: tuple[int, ...] = ()) -> tuple[SeparatePlacement, SeparatePlacement, list, threading.Thread]:
    """Trainer rank 0 (its control channel to one engine rank, played by a thread that answers as
    an engine rank's main thread does: a Generate is done at once, except the requests in
    ``stalls``, never done; a Collect sends its rollouts, the last message) and trainer rank 1,
    which asks rank 0 for a cut through the store. Returns (rank 0, rank 1, the messages the engine
    got, its thread)."""
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=20)
    groups = [None, None]

    def member(m: int) -> None:
        groups[m] = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), m, 2, timeout)

    joiner = threading.Thread(target=member, args=(1,))
    joiner.start()
    member(0)
    joiner.join()
    channel = lambda m: Channel(dist.PrefixStore("channel/", store), groups[m], wait_s=20,  # noqa: E731
                                waits_for="trainer rank 0")
    progress = Progress(dist.PrefixStore("progress/", store), 1)
    links = EngineLinks(control=channel(0), progress=progress, stream=None, transfer=None, member=0, device=None)
    cuts = dist.PrefixStore("cuts/", store)
    split = dict(is_trainer=True, world_size=3, num_trainers=2, num_engines=1, wait_s=20.0, cuts=cuts)
    leader = SeparatePlacement(RemoteEngines(WorldSplit(rank=0, links=links, **split)))
    other = SeparatePlacement(RemoteEngines(WorldSplit(rank=1, **split)))
    leader._leaders = [0]  # what Start sets: engine rank 0 answers for the replica
    engine, seen = channel(1), []

    def serve() -> None:
        while True:
            message = engine.receive()
            seen.append(message)
            if isinstance(message, Generate) and message.request not in stalls:
                progress.done(message.request)
            elif isinstance(message, Collect):
                send_object(groups[1], ([[]], 0.0), 0)
                return

    thread = threading.Thread(target=serve)
    thread.start()
    return leader, other, seen, thread


@pytest.mark.parametrize("who", ["trainer rank 0", "trainer rank 1"])
def test_a_stop_cuts_a_wait_for_a_batch_and_the_engines_abort_it(who):
    """A stop's watchdog cuts the step short while rank 0 waits for its batch (its own signal, or one
    that reached rank 1 alone): the wait ends with GenerationAborted and the engines are told to
    abort that batch, not one asked for ahead (finished: the cut's save collects it); the cut is
    cleared as the step's generation ends, and the next batch is collected as usual."""
    leader, other, seen, engine = _linked(stalls=(2,))
    params = SamplingParams(max_tokens=4)
    leader.arm_abort()  # the step's generation begins
    ahead, batch = leader.submit([[3]], 2, params), leader.submit([[1, 2]], 2, params)
    _later(0.3, (leader if who == "trainer rank 0" else other).abort)
    started = time.monotonic()
    with pytest.raises(GenerationAborted, match="a stop cut the step short"):
        leader.collect(batch)
    assert 0.25 < time.monotonic() - started < 2.0
    leader.clear_abort()
    assert leader.collect(ahead) == (range(1), [[]])
    engine.join(5)
    assert [type(m).__name__ for m in seen] == ["Generate", "Generate", "Cancel", "Collect"]
    assert (seen[2].requests, seen[2].why) == ((batch,), "cut short at a stop")


def test_a_cut_asked_for_outside_a_steps_generation_cuts_nothing():
    """Rank 1's request that comes after rank 0's generation ended (its signal, a moment later) is
    not read until the next step's generation, which forgets it (the stop then ends the run after
    the step): the evaluation's batch that follows, still generating, is waited for in full, and so
    is the next step's."""
    leader, other, seen, engine = _linked(stalls=(1,))
    params = SamplingParams(max_tokens=4)
    leader.arm_abort()
    leader.clear_abort()  # the step's generation ended
    other.abort()
    stalled = leader.submit([[1]], 1, params)  # the evaluation's batch, done 0.3 s later
    _later(0.3, lambda: leader.split.links.progress.done(stalled))
    assert leader.collect(stalled) == (range(1), [[]])
    engine.join(5)
    assert [type(m).__name__ for m in seen] == ["Generate", "Collect"]
    leader.arm_abort()  # the next step's generation: the old request is forgotten
    assert leader._cut_deadline() is None
