"""Engines that stall: a generation batch still in flight when a stop must save, for the tests of a
stop that cannot wait for it (tests/functional/test_async_rollouts.py, test_async_rollouts_vllm.py).

``StallingHFEngine`` is the real HF engine; the engine's call numbered ``$STALL_CALL`` (from 1;
training batches and evaluations alike) waits until the engine is aborted (then it raises, as a
batch aborted while decoding does) or ``$STALL_S`` seconds (default ``MAX_STALL_S``) have passed
(then it generates what it would have), and says when its stall begins and how it ended. A call
number, not a file a test creates: a test cannot create one between two batches that an engine runs
back to back.
``StallingVLLMEngine`` is the real vLLM engine; such a batch stalls the same way after its requests
are in vLLM, before its first engine step, so that an abort goes through the real one: vLLM ends
the requests and the replicas leave their data-parallel lockstep together.
Run as the trainer's command (``python -m tests.helpers.stalling_engine train ...``, also under
torchrun) it registers them as ``rollout.engine=stalling_hf`` and ``stalling_vllm`` in every process,
the engine ranks' included, and runs the CLI.
"""

import os
import sys
import time

from megatron_dapo.rollout.engine import ENGINES
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.vllm_engine import VLLMEngine

MAX_STALL_S = 120.0


def _stall(engine) -> None:
    engine.calls = getattr(engine, "calls", 0) + 1
    if engine.calls != int(os.environ.get("STALL_CALL", "0")):
        return
    aborted, started = engine._aborted, time.monotonic()
    limit = float(os.environ.get("STALL_S", MAX_STALL_S))
    print(f"stalling engine: call {engine.calls} stalls", file=sys.stderr, flush=True)
    while not aborted.is_set() and time.monotonic() - started < limit:
        time.sleep(0.05)
    how = "by an abort" if aborted.is_set() else ("timed out" if limit == MAX_STALL_S else f"after {limit:g} s")
    print(f"stalling engine: call {engine.calls} stall ended {how}", file=sys.stderr, flush=True)


class StallingHFEngine(HFEngine):
    def generate(self, prompt_ids, n, params, *, prompt_indices=None):
        _stall(self)
        return super().generate(prompt_ids, n, params, prompt_indices=prompt_indices)


class StallingVLLMEngine(VLLMEngine):
    def _run(self, ids):
        _stall(self)
        return super()._run(ids)


def register() -> None:
    for name, cls in (("stalling_hf", "StallingHFEngine"), ("stalling_vllm", "StallingVLLMEngine")):
        if name not in ENGINES:
            ENGINES.register(name)(f"tests.helpers.stalling_engine:{cls}")


if __name__ == "__main__":
    register()
    from megatron_dapo.cli import main

    sys.exit(main())  # as `python -m megatron_dapo.cli`: the process's own command
