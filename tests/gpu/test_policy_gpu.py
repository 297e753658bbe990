"""GPU-only checks of the policy model: Transformer Engine spec, bf16, FP8 (skipped without CUDA).

Written against megatron-core 0.19.2 and TE as pinned in container/Dockerfile; not run on the CPU
CI. One process, NCCL world of one. The TE spec fuses the pre-attention / pre-MLP RMSNorm into
``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``); everything else keeps the local spec's
names, which is what ``LOCAL_TO_TE`` states.
"""

import os
import socket

import pytest
import torch

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.policy import build_model, destroy_parallel, initialize_parallel, vocab_parallel_logprobs
from tests.distributed.harness import VOCAB, tiny_hf_config

pytestmark = pytest.mark.gpu
ONE = ParallelConfig()
LOCAL_TO_TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@pytest.fixture
def world_of_one(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    yield lambda hf, model: initialize_parallel(hf, parallel=ONE, model=model, seed=5)
    destroy_parallel()


def _batch(seq=16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g).cuda()
    return ids, torch.arange(seq, device="cuda").expand(2, seq), torch.roll(ids, -1, 1)


def _te_name(local_name: str) -> str:
    for old, new in LOCAL_TO_TE.items():
        if local_name.endswith(old):
            return local_name[: -len(old)] + new
    return local_name


def test_te_spec_bf16_builds_and_runs(world_of_one):
    hf, model_cfg = tiny_hf_config(), ModelConfig(make_vocab_size_divisible_by=8)  # auto: TE + bf16
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    assert model.config.transformer_impl == "transformer_engine" and model.config.bf16
    names = dict(model.named_parameters())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in names.values())
    ids, pos, targets = _batch()
    logits = model(ids, pos, None)
    assert logits.shape == (2, 16, VOCAB) and logits.dtype == torch.bfloat16
    lp, ent = vocab_parallel_logprobs(logits, targets, temperature=1.0, valid_vocab_size=VOCAB)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and torch.isfinite(ent).all()
    lp.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_te_spec_matches_local_spec(world_of_one):
    """Same weights, fp32, TE layers vs megatron's local layers: the same log-probs."""
    hf = tiny_hf_config()
    local_cfg, te_cfg = (ModelConfig(make_vocab_size_divisible_by=8, transformer_impl=impl, dtype="fp32")
                         for impl in ("local", "transformer_engine"))
    world_of_one(hf, local_cfg)
    (local,) = build_model(hf, model=local_cfg, parallel=ONE)
    (te,) = build_model(hf, model=te_cfg, parallel=ONE)
    te_params = dict(te.named_parameters())
    with torch.no_grad():
        for name, param in local.named_parameters():
            te_params[_te_name(name)].copy_(param)
        ids, pos, targets = _batch()
        lp_local = vocab_parallel_logprobs(local(ids, pos, None), targets, temperature=1.0)[0]
        lp_te = vocab_parallel_logprobs(te(ids, pos, None), targets, temperature=1.0)[0]
    torch.testing.assert_close(lp_te, lp_local, rtol=0, atol=2e-3)  # TF32 / fused attention round-off


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs Ada / Hopper or newer")
@pytest.mark.parametrize("fp8,recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_fp8_switch_builds_and_runs(world_of_one, fp8, recipe):
    hf = tiny_hf_config()
    model_cfg = ModelConfig(make_vocab_size_divisible_by=8, fp8=fp8, fp8_recipe=recipe)
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    assert (model.config.fp8, model.config.fp8_recipe) == (fp8, recipe)
    ids, pos, targets = _batch(seq=16)  # 32 tokens: FP8 GEMMs want multiples of 16
    lp, _ = vocab_parallel_logprobs(model(ids, pos, None), targets, temperature=1.0, valid_vocab_size=VOCAB)
    lp.mean().backward()
    assert torch.isfinite(lp).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_te_recompute_builds_and_runs(world_of_one, recompute):
    hf, model_cfg = tiny_hf_config(), ModelConfig(make_vocab_size_divisible_by=8, recompute=recompute)
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    assert model.config.recompute_granularity == recompute
    ids, pos, targets = _batch()
    vocab_parallel_logprobs(model(ids, pos, None), targets, temperature=1.0)[0].mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_logprobs_on_cuda_match_log_softmax():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(4, 33, 1000, device="cuda", generator=g)).bfloat16().requires_grad_()
    target = torch.randint(0, 1000, (4, 33), device="cuda", generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, temperature=0.6, chunk_tokens=16)
    ref = torch.log_softmax(logits.float() / 0.6, -1)
    torch.testing.assert_close(lp, ref.gather(-1, target[..., None]).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=0, atol=1e-4)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
