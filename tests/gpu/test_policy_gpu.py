"""GPU-only checks of the policy model: Transformer Engine spec, bf16, FP8 (skipped without CUDA).

Written against megatron-core 0.19.2 and TE as pinned in container/Dockerfile; not run on the CPU
CI. One process, NCCL world of one. The TE spec fuses the pre-attention / pre-MLP RMSNorm into
``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``); everything else keeps the local spec's
names, which is what ``LOCAL_TO_TE`` states.

Value references: the same weights in transformers' Qwen2ForCausalLM in fp32 (``hf_twin``, loaded
through the tests' own HF -> megatron map, tests/helpers/convert.hf_to_megatron_by_hand, not through
megatron_dapo.convert); FP8 against the bf16 TE model with those weights; recompute against no
recompute. Tolerances were sized on CPU (HF Qwen2 with these weights, bf16 vs fp32; FP8 emulated as
per-tensor e4m3 rounding of every transformer-layer GEMM's input and weight, scale 1 as delayed
scaling's first step and amax-based as tensorwise): see the constants below.
"""

import importlib.util

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.mcore import (
    build_model,
    destroy_parallel,
    hf_arch,
    initialize_parallel,
    vocab_parallel_logprobs,
)
from tests.helpers.convert import hf_to_megatron_by_hand
from tests.helpers.policy import VOCAB, tiny_hf_config

pytestmark = pytest.mark.gpu
requires_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="Transformer Engine is not installed (it comes with the NGC container)")
ONE = ParallelConfig()
LOCAL_TO_TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# bf16 TE model vs the fp32 twin. Measured on CPU with hf_twin's weights, bf16 vs fp32 (megatron's local
# spec; HF Qwen2): logits max 0.039 (0.029), log-probs max 0.031 (0.017), worst per-tensor gradient
# relative error 0.020 (0.026); the tolerances are ~5x that. A wrong weight layout or kernel moves them
# far more (HF, fp32): norm weights left at 1 -> logits 1.8 / log-probs 0.97, q/k/v bias dropped ->
# 1.1 / 0.82, gate/up swapped -> 2.3 / 0.77, k/v swapped -> 3.9 / 2.2; megatron's own init -> ~3.
BF16_LOGITS_ATOL, BF16_LOGPROBS_ATOL, BF16_GRAD_RTOL = 0.2, 0.15, 0.15
# FP8 vs bf16, same weights and batch (emulated: loss within 0.009, mean |log-prob diff| 0.06-0.07;
# broken GEMMs - zero, x2, x0.5 outputs, or inputs shifted a token - give mean diffs of 0.49-0.75).
# The loss barely sees a wrong model on random targets (0.03-0.11 for those), so it is a loose check;
# the per-token mean is the one that catches a wrong result.
FP8_LOSS_ATOL, FP8_LOGPROBS_MEAN_ATOL = 0.05, 0.2
# Recompute vs no recompute in the same bf16 TE model: the same kernels, so only atomics' order
# (e.g. the attention backward) may differ; a recompute from wrong inputs is off by O(1).
RECOMPUTE_LOGPROBS_ATOL, RECOMPUTE_GRAD_RTOL = 2e-2, 5e-2


@pytest.fixture
def world_of_one(world_of_one_env):
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


def hf_twin(hf: dict, seed: int = 0) -> Qwen2ForCausalLM:
    """transformers' Qwen2 for the same config, fp32, eager attention, on the GPU. Weights drawn so
    that a wrong layout shows: matrices and biases N(0, 0.1) (logits of std ~0.8 rather than the
    near-uniform ones of the 0.02 init), norm weights 1 + N(0, 0.2) (a dropped fused-norm weight
    shows); all rounded to bf16 values, so a bf16 model holds exactly these weights."""
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs, rope_theta=hf["rope_parameters"]["rope_theta"],
                                         attn_implementation="eager"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.copy_(((1.0 if norm else 0.0) + (0.2 if norm else 0.1) * torch.randn(p.shape, generator=g))
                    .bfloat16().float())
    return model.cuda().eval()


def te_layout(hf: dict, tensors: dict) -> dict:
    """HF-named tensors (weights or their grads) -> TE-spec megatron names and layout."""
    return {_te_name(k): v for k, v in hf_to_megatron_by_hand(tensors, hf_arch(hf)).items()}


def load_twin(model, twin, hf: dict) -> None:
    """Every parameter of a TE-spec model from the twin (cast to the model's dtype)."""
    state = te_layout(hf, {n: p.detach() for n, p in twin.named_parameters()})
    params = dict(model.named_parameters())
    assert set(params) == set(state), set(params) ^ set(state)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


def twin_logprobs(twin, ids, targets):
    """(fp32 logits, log-probs of targets) of the HF twin."""
    logits = twin(input_ids=ids).logits.float()
    return logits, torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def grad_errors(model, reference: dict) -> dict:
    """{name: |grad - reference| / |reference|} (Frobenius norms) for every parameter."""
    return {n: ((p.grad.float() - reference[n].float()).norm() / reference[n].float().norm()).item()
            for n, p in model.named_parameters()}


@requires_te
def test_te_spec_bf16_builds_and_runs(world_of_one):
    hf, model_cfg = tiny_hf_config(), ModelConfig(make_vocab_size_divisible_by=8)  # auto: TE + bf16
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    assert model.config.transformer_impl == "transformer_engine" and model.config.bf16
    # megatron's fused SwiGLU and TE's fused rope in use: the logits and grads below go through them
    assert model.config.bias_activation_fusion and model.config.apply_rope_fusion
    names = dict(model.named_parameters())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in names.values())
    ids, pos, targets = _batch()
    twin = hf_twin(hf)
    ref_logits, ref_lp = twin_logprobs(twin, ids, targets)
    with torch.no_grad():  # the comparison can fail: megatron's own init is another model
        assert (model(ids, pos, None).float() - ref_logits).abs().max() > 5 * BF16_LOGITS_ATOL
    load_twin(model, twin, hf)
    logits = model(ids, pos, None)
    assert logits.shape == (2, 16, VOCAB) and logits.dtype == torch.bfloat16
    lp, ent = vocab_parallel_logprobs(logits, targets, temperature=1.0, valid_vocab_size=VOCAB)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and torch.isfinite(ent).all()
    lp.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(logits.float(), ref_logits.detach(), rtol=0, atol=BF16_LOGITS_ATOL)
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), rtol=0, atol=BF16_LOGPROBS_ATOL)
    ref_lp.mean().backward()
    errors = grad_errors(model, te_layout(hf, {n: p.grad for n, p in twin.named_parameters()}))
    assert max(errors.values()) < BF16_GRAD_RTOL, errors


@requires_te
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


@requires_te
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs Ada / Hopper or newer")
@pytest.mark.parametrize("fp8,recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_fp8_switch_builds_and_runs(world_of_one, fp8, recipe):
    hf = tiny_hf_config()
    model_cfg = ModelConfig(make_vocab_size_divisible_by=8, fp8=fp8, fp8_recipe=recipe)
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    (bf16,) = build_model(hf, model=ModelConfig(make_vocab_size_divisible_by=8), parallel=ONE)
    assert (model.config.fp8, model.config.fp8_recipe) == (fp8, recipe) and bf16.config.fp8 is None
    twin = hf_twin(hf)
    load_twin(model, twin, hf)
    load_twin(bf16, twin, hf)
    ids, pos, targets = _batch(seq=16)  # 32 tokens: FP8 GEMMs want multiples of 16
    with torch.no_grad():
        ref = vocab_parallel_logprobs(bf16(ids, pos, None), targets, temperature=1.0, valid_vocab_size=VOCAB)[0]
    lp, _ = vocab_parallel_logprobs(model(ids, pos, None), targets, temperature=1.0, valid_vocab_size=VOCAB)
    lp.mean().backward()
    assert torch.isfinite(lp).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    loss, ref_loss = -lp.mean().item(), -ref.mean().item()
    assert abs(loss - ref_loss) < FP8_LOSS_ATOL, (loss, ref_loss)
    per_token = (lp.detach() - ref).abs().mean().item()
    assert per_token < FP8_LOGPROBS_MEAN_ATOL, per_token


@requires_te
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_te_recompute_builds_and_runs(world_of_one, recompute):
    hf, model_cfg = tiny_hf_config(), ModelConfig(make_vocab_size_divisible_by=8, recompute=recompute)
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    (plain,) = build_model(hf, model=ModelConfig(make_vocab_size_divisible_by=8), parallel=ONE)
    assert model.config.recompute_granularity == recompute and plain.config.recompute_granularity is None
    twin = hf_twin(hf)
    ids, pos, targets = _batch()
    lps = []
    for m in (model, plain):
        load_twin(m, twin, hf)
        lp = vocab_parallel_logprobs(m(ids, pos, None), targets, temperature=1.0)[0]
        lp.mean().backward()
        lps.append(lp.detach())
    assert all(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(lps[0], lps[1], rtol=0, atol=RECOMPUTE_LOGPROBS_ATOL)
    errors = grad_errors(model, {n: p.grad for n, p in plain.named_parameters()})
    assert max(errors.values()) < RECOMPUTE_GRAD_RTOL, errors


def test_local_spec_bf16_on_cuda_matches_the_hf_twin(world_of_one):
    """megatron's local spec (no TE: what runs on a GPU machine outside the container) in bf16 on
    CUDA, against the fp32 HF twin: the same bounds as the TE spec."""
    hf, model_cfg = tiny_hf_config(), ModelConfig(make_vocab_size_divisible_by=8, transformer_impl="local")
    world_of_one(hf, model_cfg)
    (model,) = build_model(hf, model=model_cfg, parallel=ONE)
    # Unwrapped (no Float16Module), the local spec's torch RMSNorm keeps fp32 weights; matrices are bf16.
    assert model.config.bf16 and all(p.is_cuda and (p.dtype == torch.bfloat16 or p.dim() == 1)
                                     for p in model.parameters())
    twin = hf_twin(hf)
    state = hf_to_megatron_by_hand({n: p.detach() for n, p in twin.named_parameters()}, hf_arch(hf))
    params = dict(model.named_parameters())
    assert set(params) == set(state), set(params) ^ set(state)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    ids, pos, targets = _batch()
    ref_logits, ref_lp = twin_logprobs(twin, ids, targets)
    logits = model(ids, pos, None)
    lp, _ = vocab_parallel_logprobs(logits, targets, temperature=1.0, valid_vocab_size=VOCAB)
    assert logits.dtype == torch.bfloat16 and lp.dtype == torch.float32
    torch.testing.assert_close(logits.float(), ref_logits.detach(), rtol=0, atol=BF16_LOGITS_ATOL)
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), rtol=0, atol=BF16_LOGPROBS_ATOL)
    lp.mean().backward()
    ref_lp.mean().backward()
    reference = hf_to_megatron_by_hand({n: p.grad for n, p in twin.named_parameters()}, hf_arch(hf))
    errors = grad_errors(model, reference)
    assert max(errors.values()) < BF16_GRAD_RTOL, errors


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
