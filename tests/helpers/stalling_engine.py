"""An HF engine that stalls: a generation batch still in flight when a stop must save, for the test
of a stop that cannot wait for it (tests/functional/test_async_rollouts.py).

``StallingHFEngine`` is the real HF engine; a batch that starts while the file named by
``$STALL_FILE`` exists waits until the test deletes it (at most ``MAX_STALL_S``) or the engine is
aborted (then it raises, as a batch aborted while decoding does), then generates.
Run as the trainer's command (``python -m tests.helpers.stalling_engine train ...``, also under
torchrun) it registers itself as ``rollout.engine=stalling_hf`` in every process, the engine ranks'
included, and runs the CLI.
"""

import os
import sys
import time
from pathlib import Path

from megatron_dapo.rollout.engine import ENGINES
from megatron_dapo.rollout.hf_engine import HFEngine

MAX_STALL_S = 120.0


class StallingHFEngine(HFEngine):
    def generate(self, prompt_ids, n, params, *, prompt_indices=None):
        marker, started = Path(os.environ.get("STALL_FILE", "/nonexistent")), time.monotonic()
        while marker.exists() and not self._aborted.is_set() and time.monotonic() - started < MAX_STALL_S:
            time.sleep(0.05)
        return super().generate(prompt_ids, n, params, prompt_indices=prompt_indices)


def register() -> None:
    if "stalling_hf" not in ENGINES:
        ENGINES.register("stalling_hf")("tests.helpers.stalling_engine:StallingHFEngine")


if __name__ == "__main__":
    register()
    from megatron_dapo.cli import main

    sys.exit(main())  # as `python -m megatron_dapo.cli`: the process's own command
