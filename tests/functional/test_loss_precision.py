"""The loss math stays fp32 when the model does not (DESIGN's numerics contract): in a bf16 update,
and in an FP8 one on odd sequence lengths, the log-probs, the ratios' inputs and the token-mean
loss are fp32; only the layers compute in bf16 / FP8.

Each case is one DAPO update of ``MegatronActor`` in a world of one, with a probe around the
policy loss that records the dtypes it is handed and returns. Values: the forward-only loss equals
``algo.compute_policy_loss`` computed by hand in fp32 on the actor's own log-probs (an independent
path through the loss), and the update moves the weights. The bf16 local-spec case runs on any
machine (CPU here: gloo); the Transformer Engine cases need CUDA and TE (tools/gpu_smoke.sh runs
them; ``test_fp8_update_on_odd_lengths`` is its fp8-step).
"""

import dataclasses
import importlib.util

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.config import ModelConfig
from megatron_dapo.policy.batching import Sample
from tests.distributed.harness import tiny_hf_config
from tests.distributed.test_policy_train_step import make_samples, tiny_cfg

# Odd lengths: no sample and no sum of them is a multiple of 16, so FP8 needs the padding rule.
ODD = [(7, 13), (5, 22), (11, 9), (3, 30), (9, 17), (13, 5), (4, 19), (6, 11)]
# FP8 vs bf16 log-probs, same weights and batch: tests/gpu/test_policy_gpu.py's bound (emulated
# FP8 gave mean differences of 0.06-0.07; broken GEMMs 0.49-0.75).
FP8_LOGPROBS_MEAN_ATOL = 0.2


@pytest.fixture
def world_of_one(world_of_one_env):
    yield
    from megatron_dapo.policy import destroy_parallel

    destroy_parallel()


@pytest.fixture
def loss_probe(monkeypatch):
    """Records, for every real call of the policy loss in the train step, the dtypes in and out."""
    import megatron_dapo.policy.train_step as ts

    seen, real = [], ts.get_policy_loss_fn

    def wrapped(name):
        fn = real(name)

        def probe(log_probs, old_log_probs, advantages, mask, **kw):
            loss, metrics = fn(log_probs, old_log_probs, advantages, mask, **kw)
            if log_probs.numel() > 1:  # not the 1-token dry run that sizes the metric buffers
                seen.append(dict(log_probs=log_probs.dtype, old=old_log_probs.dtype, adv=advantages.dtype,
                                 loss=loss.dtype, metric=metrics["actor/ratio_mean"].dtype,
                                 grad=log_probs.requires_grad))
            return loss, metrics
        return probe

    monkeypatch.setattr(ts, "get_policy_loss_fn", wrapped)
    return seen


def hf_dir(path) -> str:
    """tiny_hf_config's model in transformers, weights N(0, 0.1) rounded to bf16 (so a bf16 model
    holds exactly these), saved as safetensors for ``MegatronActor.load_hf_weights``."""
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


def make_actor(weights: str, dist_opt: bool = True, **model):
    from megatron_dapo.policy.actor import MegatronActor

    cfg = tiny_cfg(budget=64, micro_batch_size=8, dist_opt=dist_opt)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype="bf16", **model))
    actor = MegatronActor(cfg, tiny_hf_config())
    assert actor.load_hf_weights(weights) > 0
    return actor


def with_old(actor, xs: list[Sample]) -> list[Sample]:
    """Old log-probs = the actor's own plus noise, so the ratios spread over the clip range."""
    lps = actor.get_inference_log_probs(xs)
    g = torch.Generator().manual_seed(1)
    return [dataclasses.replace(x, old_log_probs=lp + 0.3 * torch.randn(lp.shape, generator=g))
            for x, lp in zip(xs, lps)]


def by_hand(actor, xs: list[Sample]) -> float:
    """The mini-batch token-mean DAPO loss in fp32 from the actor's own log-probs."""
    lps = actor.get_inference_log_probs(xs)
    assert all(lp.dtype == torch.float32 for lp in lps)
    cfg = actor.cfg.loss
    lp, old = torch.cat(lps)[None], torch.cat([x.old_log_probs for x in xs])[None]
    adv = torch.cat([torch.full((x.num_response_tokens,), float(x.advantages)) for x in xs])[None]
    mask = torch.cat([torch.ones(x.num_response_tokens) if x.loss_mask is None else x.loss_mask for x in xs])[None]
    loss, _ = compute_policy_loss(lp, old, adv, mask, clip_ratio_low=cfg.clip_ratio_low,
                                  clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c)
    return loss.item()


def update_and_check(actor, xs: list[Sample], seen: list) -> dict:
    """Forward-only loss vs the hand-computed one; then one update: fp32 loss math, finite
    metrics, weights moved."""
    forward = actor.get_loss_and_metrics(xs, forward_only=True)["actor/pg_loss"]
    assert forward == pytest.approx(by_hand(actor, xs), abs=1e-4)
    before = {n: p.detach().float().clone() for n, p in actor.model[0].named_parameters()}
    seen.clear()
    metrics = actor.get_loss_and_metrics(xs)
    assert seen and all(s == dict(log_probs=torch.float32, old=torch.float32, adv=torch.float32,
                                  loss=torch.float32, metric=torch.float32, grad=True) for s in seen), seen
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    moved = max((p.detach().float() - before[n]).abs().max().item() for n, p in actor.model[0].named_parameters())
    assert moved > 1e-4, moved
    return dict(forward=forward, **metrics)


@pytest.mark.anydevice
@pytest.mark.parametrize("dist_opt", [True, False], ids=["dist_opt", "plain_opt"])
def test_bf16_update_keeps_loss_math_fp32(world_of_one, loss_probe, tmp_path, dist_opt):
    """Also: every parameter on the compute device (without the distributed optimizer no buffer
    re-homes the params; the first GPU run found the local spec's norms left on the CPU)."""
    from megatron_dapo.policy.train_step import compute_device

    actor = make_actor(hf_dir(tmp_path), transformer_impl="local", dist_opt=dist_opt)
    params = dict(actor.model[0].named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())  # the layers really are bf16
    assert all(p.device.type == compute_device().type for p in params.values())
    xs = with_old(actor, make_samples(0, shapes=ODD))
    update_and_check(actor, xs, loss_probe)


requires_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="Transformer Engine is not installed (it comes with the NGC container)")


@pytest.mark.gpu
@requires_te
def test_te_bf16_update_keeps_loss_math_fp32(world_of_one, loss_probe, tmp_path):
    actor = make_actor(hf_dir(tmp_path), transformer_impl="transformer_engine")
    update_and_check(actor, with_old(actor, make_samples(0, shapes=ODD)), loss_probe)


@pytest.mark.gpu
@requires_te
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs Ada / Hopper or newer")
def test_fp8_update_on_odd_lengths(world_of_one, loss_probe, tmp_path):
    """tools/gpu_smoke.sh's fp8-step: FP8 (hybrid, delayed scaling) on lengths that TE's FP8 GEMMs
    reject unless padded (policy/batching.pad_multiple); the FP8 log-probs are near the bf16 TE
    model's on the same weights, and not equal to them (FP8 really ran)."""
    from megatron_dapo.policy import destroy_parallel

    weights, xs = hf_dir(tmp_path), make_samples(0, shapes=ODD)
    actor = make_actor(weights, transformer_impl="transformer_engine", fp8="hybrid")
    assert actor.settings.pad_multiple % 16 == 0
    fp8_lps = torch.cat(actor.get_inference_log_probs(xs))
    update_and_check(actor, with_old(actor, xs), loss_probe)
    destroy_parallel()
    bf16 = make_actor(weights, transformer_impl="transformer_engine")
    diff = (fp8_lps - torch.cat(bf16.get_inference_log_probs(xs))).abs().mean().item()
    assert 1e-4 < diff < FP8_LOGPROBS_MEAN_ATOL, diff
