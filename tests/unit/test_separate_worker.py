"""An engine rank's worker (rollout/engine_server.py ``Worker``) cancelling generation requests, with
the real HF engine in one process: a queued request cancelled ends at once, before its prefill; one
cancelled while it generates is aborted; one cancelled after it finished has its result dropped;
and the requests after a cancelled one generate what they would have (the engine's abort flag is
cleared as the worker enters them). Every request, aborted or not, counts the worker done in the
progress counters (a real store). The trainers' side and the links run in
tests/functional/test_async_rollouts.py."""

import logging
import time

import pytest
import torch.distributed as dist

from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout.engine_server import Worker
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.protocol import Generate, Progress, Start, Stop
from megatron_dapo.rollout.worlds import EngineLinks, WorldSplit
from tests.helpers.rollout import tiny_qwen2
from tests.helpers.stalling_engine import StallingHFEngine

PROMPTS = [[5, 17, 42, 8], [7, 9, 11]]
PARAMS = SamplingParams(max_tokens=8, seed=3)


class _OneReplica(Worker):
    """The worker with an engine given instead of one built from a run's config: the one replica's
    leader, its progress in a store of its own."""

    def __init__(self, engine):
        links = EngineLinks(control=None, progress=Progress(dist.HashStore(), 1), stream=None, transfer=None,
                            member=1, device=None)
        super().__init__(WorldSplit(is_trainer=False, rank=1, world_size=2, num_trainers=1, num_engines=1,
                                    links=links))
        self.given, self.aborts = engine, engine.aborts

    def _build(self, spec):
        return self.given, True, 0, 1

    def done(self, request: int) -> bool:
        return self.links.progress.count(request) == 1


def _start(engine, *requests: int) -> _OneReplica:
    worker = _OneReplica(engine)
    for item in [Start(None)] + [Generate(r, PROMPTS, 2, PARAMS) for r in requests]:
        worker.work.put(item)
    return worker


def _responses(worker: _OneReplica, request: int, timeout: float = 60.0) -> list[list[list[int]]]:
    deadline = time.monotonic() + timeout
    while not worker.done(request):
        assert time.monotonic() < deadline, f"request {request} never finished"
        time.sleep(0.01)
    rollouts, _ = worker.result(request)
    return [[r.response_ids for r in group] for group in rollouts]


def _stop(worker: _OneReplica) -> None:
    worker.work.put(Stop())
    worker.join(timeout=30)
    worker.raise_error()


@pytest.fixture(scope="module")
def want() -> list[list[list[int]]]:
    """What the prompts draw from an engine never aborted."""
    out = HFEngine(tiny_qwen2(0), eos_token_ids=()).generate(PROMPTS, 2, PARAMS)
    return [[r.response_ids for r in group] for group in out]


def test_a_queued_request_cancelled_ends_before_its_prefill_and_the_next_generates_as_before(want, caplog):
    worker = _start(HFEngine(tiny_qwen2(0), eos_token_ids=()), 1, 2, 3)
    worker.cancel([2])  # before the worker took it
    with caplog.at_level(logging.INFO, logger="megatron_dapo.rollout.engine_server"):
        worker.start()
        assert _responses(worker, 1) == want and _responses(worker, 3) == want
        _stop(worker)
    assert "generation request 2 cancelled, aborted" in caplog.text
    assert worker.done(2) and 2 not in worker.results and worker.served == 2


def test_a_request_cancelled_while_it_generates_is_aborted(want, monkeypatch, caplog):
    monkeypatch.setenv("STALL_CALL", "1")  # request 1 waits until aborted (tests/helpers/stalling_engine.py)
    worker = _start(StallingHFEngine(tiny_qwen2(0), eos_token_ids=()), 1, 2)
    with caplog.at_level(logging.INFO, logger="megatron_dapo.rollout.engine_server"):
        worker.start()
        while worker._current != 1:
            time.sleep(0.01)
        worker.cancel([1])
        assert _responses(worker, 2) == want
        _stop(worker)
    assert "generation request 1 cancelled, aborted" in caplog.text and 1 not in worker.results


def test_a_cancel_after_the_request_finished_drops_its_result(want):
    worker = _start(HFEngine(tiny_qwen2(0), eos_token_ids=()), 1)
    worker.start()
    deadline = time.monotonic() + 60
    while not worker.done(1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.cancel([1])
    assert 1 not in worker.results
    worker.work.put(Generate(2, PROMPTS, 2, PARAMS))
    assert _responses(worker, 2) == want  # no abort flag left behind
    _stop(worker)
