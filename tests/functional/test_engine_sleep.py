"""The memory-phase order of a real (1-process) training run of the CPU demo, recorded from a wrapped
HF engine: the engine sleeps while the trainer works and wakes to take the new weights and generate.
RolloutPlacement's shares and layout without a process group are tests/unit/test_rollout_placement.py."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.demo import copy_demo_base

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


_RECORDING_RUN = textwrap.dedent("""
    import json, sys
    import megatron_dapo.rollout.engine as engine_module
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.train import train

    calls = []

    class Recording(HFEngine):
        # sleep/wake are no-ops on CPU: what matters here is when the loop calls them.
        def generate(self, *args, **kwargs):
            calls.append("generate")
            return super().generate(*args, **kwargs)

        def update_weights(self, weights):
            calls.append("update_weights")
            super().update_weights(weights)

        def sleep(self):
            calls.append("sleep")

        def wake_up(self):
            calls.append("wake_up")

    engine_module.get_engine_cls = lambda name: Recording
    import megatron_dapo.mcore.actor as actor_module
    Actor = actor_module.MegatronActor
    for method, tag in (("get_inference_log_probs", "old_log_probs"), ("get_loss_and_metrics", "update")):
        def wrapped(self, *a, _orig=getattr(Actor, method), _tag=tag, **k):
            calls.append(_tag)
            return _orig(self, *a, **k)
        setattr(Actor, method, wrapped)
    if __name__ == "__main__":  # the reward pool's spawned workers import this file too
        train(load_config(sys.argv[1], sys.argv[3:]))
        open(sys.argv[2], "w").write(json.dumps(calls))
""")


def test_engine_sleeps_through_training_and_wakes_to_generate(demo_base, tmp_path):
    copy_demo_base(demo_base, tmp_path / "run")
    script = tmp_path / "record.py"
    script.write_text(_RECORDING_RUN)
    out = tmp_path / "calls.json"
    # A plain one-process run: no launcher variables (in-process tests of this session may have set some).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(
        [sys.executable, str(script), str(ROOT / "conf" / "cpu_tiny.yaml"), str(out), f"logging.dir={tmp_path / 'run'}",
         "train.total_steps=2", "eval.every=1", "logging.tensorboard=false",
         "train.old_log_probs=trainer",  # the recompute pass among the phases (the demo takes the engine's)
         "checkpoint.save_every=0"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    calls = json.loads(out.read_text())
    # Collapse repeats (several generation batches, buckets and updates) into the phase sequence.
    phases = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
    # A step after its rollouts: the trainer gets the memory, the weights go into the sleeping
    # engine, which wakes to evaluate and to generate the next step's rollouts (one "generate" run).
    step = ["sleep", "old_log_probs", "update", "update_weights", "wake_up", "generate"]
    assert phases == ["update_weights", "generate"] + step + step, phases
    asleep = False
    for c in calls:
        asleep = {"sleep": True, "wake_up": False}.get(c, asleep)
        assert not (asleep and c == "generate"), "generated while asleep"
        assert asleep or c not in ("old_log_probs", "update"), f"{c} while the engine was awake"
