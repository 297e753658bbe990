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

import importlib.util

import pytest
import torch

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.batching import Sample
from tests.helpers.policy import ODD, bf16_actor, bf16_hf_dir, make_samples, with_actor_log_probs

# FP8 vs bf16 log-probs, same weights and batch: tests/gpu/test_policy_gpu.py's bound (emulated
# FP8 gave mean differences of 0.06-0.07; broken GEMMs 0.49-0.75).
FP8_LOGPROBS_MEAN_ATOL = 0.2


@pytest.fixture
def loss_probe(monkeypatch):
    """Records, for every real call of the policy loss in the train step, the dtypes in and out."""
    import megatron_dapo.mcore.step_settings as ts  # where StepSettings.policy_loss_fn finds the loss

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


def by_hand(actor, xs: list[Sample]) -> float:
    """The mini-batch token-mean DAPO loss in fp32 from the actor's own log-probs."""
    lps = actor.get_inference_log_probs(xs)
    assert all(lp.dtype == torch.float32 for lp in lps)
    cfg = actor.cfg.loss_settings()
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
    from megatron_dapo.mcore.step_settings import compute_device

    actor = bf16_actor(bf16_hf_dir(tmp_path), transformer_impl="local", dist_opt=dist_opt)
    params = dict(actor.model[0].named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())  # the layers really are bf16
    assert all(p.device.type == compute_device().type for p in params.values())
    xs = with_actor_log_probs(actor, make_samples(0, shapes=ODD), seed=1)
    update_and_check(actor, xs, loss_probe)


requires_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="Transformer Engine is not installed (it comes with the NGC container)")


@pytest.mark.gpu
@requires_te
def test_te_bf16_update_keeps_loss_math_fp32(world_of_one, loss_probe, tmp_path):
    actor = bf16_actor(bf16_hf_dir(tmp_path), transformer_impl="transformer_engine")
    update_and_check(actor, with_actor_log_probs(actor, make_samples(0, shapes=ODD), seed=1), loss_probe)


@pytest.mark.gpu
@requires_te
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs Ada / Hopper or newer")
def test_fp8_update_on_odd_lengths(world_of_one, loss_probe, tmp_path):
    """tools/gpu_smoke.sh's fp8-step: FP8 (hybrid, delayed scaling) on lengths that TE's FP8 GEMMs
    reject unless padded (batching.pad_multiple); the FP8 log-probs are near the bf16 TE
    model's on the same weights, and not equal to them (FP8 really ran)."""
    from megatron_dapo.mcore import destroy_parallel

    weights, xs = bf16_hf_dir(tmp_path), make_samples(0, shapes=ODD)
    actor = bf16_actor(weights, transformer_impl="transformer_engine", fp8="hybrid")
    assert actor.settings.pad_multiple % 16 == 0
    fp8_lps = torch.cat(actor.get_inference_log_probs(xs))
    update_and_check(actor, with_actor_log_probs(actor, xs, seed=1), loss_probe)
    destroy_parallel()
    bf16 = bf16_actor(weights, transformer_impl="transformer_engine")
    diff = (fp8_lps - torch.cat(bf16.get_inference_log_probs(xs))).abs().mean().item()
    assert 1e-4 < diff < FP8_LOGPROBS_MEAN_ATOL, diff
