"""RolloutPlacement without a process group: shares, the replica layout and its errors, and the
rollout settings' checks. The memory-phase order of a real training run is
tests/functional/test_engine_sleep.py."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dapo.rollout.placement import replica_layout, shard_range


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


def test_rollout_settings_fail_as_one_config_error_before_heavy_work(monkeypatch):
    import importlib.util

    from megatron_dapo.config import DAPOConfig, RolloutConfig
    from megatron_dapo.config_loading import ConfigError
    from megatron_dapo.launch_checks import check_rollout

    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=3 does not divide the world size 4"):
        check_rollout(DAPOConfig(rollout=RolloutConfig(engine="hf", tensor_parallel_size=3)), 4)
    vllm = DAPOConfig(rollout=RolloutConfig(engine="vllm"))
    with pytest.raises(ConfigError, match="vLLM on CPU needs an explicit KV-cache size: set "
                       "rollout.kv_cache_memory_mb"):
        check_rollout(vllm, 1)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs the vllm package: on a CPU run `./install.sh vllm`"):
        check_rollout(vllm, 1)
