"""Engines that stall: a generation batch still in flight when a stop must save, for the tests of a
stop that cannot wait for it (tests/functional/test_async_rollouts.py, test_async_rollouts_vllm.py).

``StallingHFEngine`` is the real HF engine; a batch that starts while the file named by
``$STALL_FILE`` exists waits until the test deletes it (at most ``MAX_STALL_S``) or the engine is
aborted (then it raises, as a batch aborted while decoding does), then generates.
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
from pathlib import Path

from megatron_dapo.rollout.engine import ENGINES
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.vllm_engine import VLLMEngine

MAX_STALL_S = 120.0


def _stall(aborted) -> None:
    marker, started = Path(os.environ.get("STALL_FILE", "/nonexistent")), time.monotonic()
    while marker.exists() and not aborted.is_set() and time.monotonic() - started < MAX_STALL_S:
        time.sleep(0.05)


class StallingHFEngine(HFEngine):
    def generate(self, prompt_ids, n, params, *, prompt_indices=None):
        _stall(self._aborted)
        return super().generate(prompt_ids, n, params, prompt_indices=prompt_indices)


class StallingVLLMEngine(VLLMEngine):
    def _run(self, ids):
        _stall(self._aborted)
        return super()._run(ids)


def register() -> None:
    for name, cls in (("stalling_hf", "StallingHFEngine"), ("stalling_vllm", "StallingVLLMEngine")):
        if name not in ENGINES:
            ENGINES.register(name)(f"tests.helpers.stalling_engine:{cls}")


if __name__ == "__main__":
    register()
    from megatron_dapo.cli import main

    sys.exit(main())  # as `python -m megatron_dapo.cli`: the process's own command
