"""The tiny policy the Megatron tests share: a Qwen2-shaped config.json, a DAPO config sized for a
2-process CPU run, random samples, and the actor-side helpers (old log-probs with noise, weight
copies, a bf16-exact HF dir). Used from tests/unit, tests/distributed, tests/functional and
tests/gpu alike; the plain-torch reference update is tests/helpers/reference.py."""

from __future__ import annotations

import dataclasses

import torch

from megatron_dapo.config import (
    DAPOConfig, DataConfig, LossConfig, ModelConfig, OptimConfig, OverlongBufferConfig, ParallelConfig,
    RewardConfig, RolloutConfig, TrainConfig,
)
from megatron_dapo.batching import Sample

VOCAB = 120  # padded to 128 rows when make_vocab_size_divisible_by=16
TEMPERATURE, LR, CLIP, ADAM_EPS = 0.8, 0.1, 0.5, 1e-2
SHAPES = [(3, 9), (5, 14), (2, 6), (7, 20), (4, 11), (6, 3), (3, 17), (8, 8)]  # (prompt, response)
# Odd lengths: no sample and no sum of them is a multiple of 16, so FP8 needs the padding rule.
ODD = [(7, 13), (5, 22), (11, 9), (3, 30), (9, 17), (13, 5), (4, 19), (6, 11)]


def tiny_hf_config(**overrides) -> dict:
    """A Qwen2-shaped config.json: GQA (4 heads, 2 KV groups), RMSNorm, SwiGLU, RoPE 1e6."""
    cfg = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
               max_position_embeddings=256, hidden_act="silu", initializer_range=0.02)
    cfg.update(overrides)
    return cfg


def tiny_cfg(*, tp=1, pp=1, vpp=None, sp=False, cp=1, dist_opt=True, budget=40, micro_batch_size=1, warmup=1):
    """Sizes for a 2-process CPU run. make_vocab_size_divisible_by=64 pads the vocabulary (120)
    to 128 (at TP=1 and 2 alike), so the reference needs the padding mask. 4 prompts per step in
    mini-batches of 2: 2 updates per rollout step, so warmup=1 step means lr / 2 on update 1."""
    return DAPOConfig(
        seed=1,
        model=ModelConfig(make_vocab_size_divisible_by=64),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp,
                                context_parallel_size=cp, use_distributed_optimizer=dist_opt),
        data=DataConfig(prompts_per_step=4, gen_prompts_per_batch=4, max_prompt_length=8),
        rollout=RolloutConfig(temperature=TEMPERATURE, max_response_length=24),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=budget,
                          micro_batch_size=micro_batch_size),
        optim=OptimConfig(lr=LR, lr_warmup_steps=warmup, adam_eps=ADAM_EPS, clip_grad=CLIP, weight_decay=0.1))


def one_process_cfg(loss: LossConfig) -> DAPOConfig:
    """One process, the default layout, 3+ micro-batches per mini-batch of make_samples(shapes=SHAPES[:6]),
    no gradient clip (the optimizer leaves ``main_grad`` as the loss made it): the loss tests' step."""
    return DAPOConfig(
        seed=1,
        model=ModelConfig(make_vocab_size_divisible_by=64),
        data=DataConfig(prompts_per_step=4, gen_prompts_per_batch=4, max_prompt_length=8),
        rollout=RolloutConfig(temperature=0.8, max_response_length=24),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=40),
        loss=loss,
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=0, clip_grad=0.0))


def make_samples(seed: int, shapes=SHAPES, vocab: int = VOCAB) -> list[Sample]:
    """Random ids below ``vocab``, per-sequence advantages of both signs, one response with a
    partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        mask = (torch.arange(r) < r // 2).float() if i == 1 else None  # e.g. a filtered tail
        out.append(Sample(prompt_ids=torch.randint(0, vocab, (p,), generator=g),
                          response_ids=torch.randint(0, vocab, (r,), generator=g),
                          advantages=float(torch.randn((), generator=g)), loss_mask=mask))
    return out


def unwrap(module):
    """The model inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def with_actor_log_probs(actor, xs: list[Sample], seed: int, log_probs=None) -> list[Sample]:
    """Old log-probs from the actor itself, plus noise so that ratios spread over the clip range."""
    g = torch.Generator().manual_seed(seed)
    log_probs = actor.get_inference_log_probs(xs) if log_probs is None else log_probs
    return [dataclasses.replace(x, old_log_probs=lp + 0.3 * torch.randn(lp.shape, generator=g))
            for x, lp in zip(xs, log_probs)]


def hf_weights(actor) -> dict:
    """Copies: export_hf_weights may yield the parameters themselves (e.g. TP-replicated norms)."""
    return {name: tensor.clone() for name, tensor in actor.export_hf_weights()}


def bf16_hf_dir(path) -> str:
    """tiny_hf_config's model in transformers, weights N(0, 0.1) rounded to bf16 (so a bf16 model
    holds exactly these), saved as safetensors for ``MegatronActor.load_hf_weights``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = tiny_hf_config()
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs, rope_theta=hf["rope_parameters"]["rope_theta"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.copy_(((1.0 if norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g)).bfloat16().float())
    model.save_pretrained(path)
    return str(path)


def bf16_actor(weights: str, dist_opt: bool = True, **model):
    """A bf16 ``MegatronActor`` of tiny_hf_config in the current world, loaded from ``weights``
    (bf16_hf_dir); ``model``: more ModelConfig fields (transformer_impl, fp8, ...)."""
    from megatron_dapo.mcore.actor import MegatronActor

    cfg = tiny_cfg(budget=64, micro_batch_size=8, dist_opt=dist_opt)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype="bf16", **model))
    actor = MegatronActor(cfg, tiny_hf_config())
    assert actor.load_hf_weights(weights) > 0
    return actor


def hint_case():
    """The output layer's gradient-hint case (mcore/logprobs.py GradHint): hidden [3, 6, 16] and
    weight [40, 16] (both requiring grad), targets [3, 6] below 36 (the valid vocab), the [3, 6]
    bool positions in the loss and per-token weights w (0 outside them)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 6, 16, generator=g).requires_grad_()
    weight = (torch.randn(40, 16, generator=g) / 2).requires_grad_()
    target = torch.randint(0, 36, (3, 6), generator=g)
    active = torch.rand(3, 6, generator=g) > 0.4  # positions in the loss
    w = torch.randn(3, 6, generator=g) * active
    return hidden, weight, target, active, w
