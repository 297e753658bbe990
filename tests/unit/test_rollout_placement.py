"""RolloutPlacement without a process group: shares, the replica layout and its errors, and the
memory-phase order of a real (1-process) training run, recorded from a wrapped HF engine."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dapo.rollout.placement import replica_layout, shard_range

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers(0, 200), st.integers(1, 16))
def test_shards_cover_the_batch_in_order_and_balanced(num_items, num_shards):
    shards = [shard_range(num_items, s, num_shards) for s in range(num_shards)]
    assert [i for r in shards for i in r] == list(range(num_items))  # contiguous, in prompt order
    sizes = [len(r) for r in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("rank,world,tp,expected", [
    (0, 1, 1, (0, 1, True)), (1, 2, 1, (1, 2, True)), (1, 2, 2, (0, 1, False)),
    (5, 8, 2, (2, 4, False)), (4, 8, 4, (1, 2, True)),
])
def test_replica_layout(rank, world, tp, expected):
    assert replica_layout(rank, world, tp) == expected


def test_rollout_tp_must_divide_the_world():
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=3 does not divide the world size 4"):
        replica_layout(0, 4, 3)


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
    import megatron_dapo.policy.actor as actor_module
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


@pytest.mark.slow
def test_engine_sleeps_through_training_and_wakes_to_generate(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(_RECORDING_RUN)
    out = tmp_path / "calls.json"
    # A plain one-process run: no launcher variables (in-process tests of this session may have set some).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(
        [sys.executable, str(script), str(ROOT / "conf" / "cpu_tiny.yaml"), str(out), f"logging.dir={tmp_path / 'run'}",
         "train.total_steps=2", "eval.every=1", "logging.tensorboard=false", "toy.warmup_steps=20",
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


def test_rollout_settings_fail_as_one_config_error_before_heavy_work(monkeypatch):
    import importlib.util

    from megatron_dapo.config import DAPOConfig, RolloutConfig
    from megatron_dapo.config_loading import ConfigError
    from megatron_dapo.setup import check_rollout

    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=3 does not divide the world size 4"):
        check_rollout(DAPOConfig(rollout=RolloutConfig(engine="hf", tensor_parallel_size=3)), 4)
    vllm = DAPOConfig(rollout=RolloutConfig(engine="vllm"))
    with pytest.raises(ConfigError, match="vLLM on CPU needs an explicit KV-cache size: set rollout.kv_cache_memory_mb"):
        check_rollout(vllm, 1)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs the vllm package: on a CPU run `./install.sh vllm`"):
        check_rollout(vllm, 1)
