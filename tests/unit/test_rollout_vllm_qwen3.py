"""vLLM's CPU build serving Qwen3 dense (the real engine, in this process): its rollouts' log-probs
equal a teacher-forced transformers Qwen3 (weight_sync.score_logprobs, fp32), and an in-place weight
sync in small buckets (q/k/v, q_norm / k_norm and gate/up of one layer in different calls) makes it
the synced model. Qwen3's own head size (4 heads of 32 over a width of 64) and random per-head norms,
so that a norm vLLM skipped, or a head size taken as width / heads, shows. Tolerances as
test_rollout_vllm_engine.py's (Qwen2)."""

import importlib.util

import pytest
import torch

from megatron_dapo.rollout import SamplingParams, sync_weights
from tests.helpers.forced_logprobs import max_logprob_diff

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (./install.sh vllm installs its CPU build)")]

TOL = 1e-4
EOS = 1
PROMPTS = [[5, 17, 42, 8], [7, 9], [100, 101, 102, 103, 104, 105, 106], [3]]


def tiny_qwen3(seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)  # peaked distributions, as the Qwen2 tests' models
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return model.float().eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_dapo.rollout import vllm_engine as ve

    old = tiny_qwen3(0)
    path = tmp_path_factory.mktemp("qwen3")
    old.save_pretrained(path)
    eng = ve.VLLMEngine(str(path), mode="standalone", in_process=True, dtype="float32", max_model_len=64, seed=0,
                        kv_cache_memory_bytes=16 << 20)
    try:
        yield eng, old
    finally:
        eng.shutdown()


def test_vllm_generates_qwen3_and_a_weight_sync_makes_it_the_new_model(engine):
    eng, old = engine
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=1)
    out = [r for group in eng.generate(PROMPTS, n=2, params=params) for r in group]
    assert len(out) == 2 * len(PROMPTS) and all(r.response_ids for r in out)
    assert max_logprob_diff(old, out) < TOL
    new = tiny_qwen3(1)
    stats = sync_weights(eng, new.state_dict().items(), bucket_bytes=64 * 128 * 4)
    assert stats["num_buckets"] > 6
    out = [r for group in eng.generate(PROMPTS, n=2, params=params) for r in group]
    assert max_logprob_diff(new, out) < TOL and max_logprob_diff(old, out) > 100 * TOL
    # a q_norm alone: the engine reads the synced per-head norm, not a copy it made at load
    norm = new.model.layers[1].self_attn.q_norm.weight.detach() * 1.7
    eng.update_weights([("model.layers.1.self_attn.q_norm.weight", norm)])
    with torch.no_grad():
        new.model.layers[1].self_attn.q_norm.weight.copy_(norm)
    assert max_logprob_diff(new, [r for g in eng.generate(PROMPTS, n=1, params=params) for r in g]) < TOL

