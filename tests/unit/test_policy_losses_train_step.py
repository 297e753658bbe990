"""GSPO and CISPO through the Megatron train step (mcore/train_step.py), one process, several micro-batches:
the gradient megatron's DDP accumulates (``main_grad``; clip_grad = 0) equals the gradient of the same loss
computed by hand over the whole batch at once (tests/helpers/reference.py's forward: one padded batch,
plain autograd, no global counts), so the global denominators and, for GSPO, the whole-response ratio
survive the micro-batch split. CISPO's token-mean takes the output layer's gradient hint; GSPO's
sequence ratio does not (train_step.PER_TOKEN_LOSSES)."""

import dataclasses

import pytest
import torch

from megatron_dapo.algo import get_policy_loss_fn
from megatron_dapo.config import LossConfig
from megatron_dapo.batching import Sample
from tests.helpers import policy
from tests.helpers.policy import one_process_cfg, tiny_hf_config
from tests.helpers.reference import reference_forward

def make_samples(actor, spread: float, per_response: float) -> list[Sample]:
    """tests/helpers/policy.make_samples's batch; old log-probs = the model's plus noise (``per_response``:
    one shift per response, so GSPO's sequence ratios spread over its clip range)."""
    from megatron_dapo.mcore.train_step import compute_log_probs

    xs = policy.make_samples(0, shapes=policy.SHAPES[:6])
    lps, _ = compute_log_probs(actor.model, xs, actor.settings)
    g = torch.Generator().manual_seed(1)
    return [dataclasses.replace(x, old_log_probs=lp + spread * torch.randn(lp.shape, generator=g)
                                + per_response * torch.randn((), generator=g)) for x, lp in zip(xs, lps)]


@pytest.mark.parametrize("policy_loss, loss, spread, per_response", [
    ("gspo", {}, 1e-4, 5e-4),  # the paper's clip range: some responses clipped, some not
    ("gspo", dict(loss_agg_mode="token-mean"), 1e-4, 5e-4),  # token-mean, yet no hint: s_i reads the response
    ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=0.3), 0.3, 0.0),  # weights clipped on both sides
])
def test_train_step_equals_the_whole_batch_loss(monkeypatch, policy_loss, loss, spread, per_response):
    from megatron_dapo.mcore import build_model, destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import train_step

    monkeypatch.delenv("RANK", raising=False)  # a one-process gloo world
    try:
        cfg = one_process_cfg(LossConfig(policy_loss=policy_loss, **loss))
        actor = MegatronActor(cfg, tiny_hf_config())
        ref = build_model(tiny_hf_config(), model=cfg.model, parallel=cfg.parallel)[0]
        ref.load_state_dict(actor.model[0].module.state_dict(), strict=False)
        xs = make_samples(actor, spread, per_response)

        fw = reference_forward(ref, xs)
        resolved = cfg.loss_settings()
        kw = resolved.loss_kwargs()
        want, _ = get_policy_loss_fn(policy_loss)(fw["lp"], fw["old"], fw["adv"], fw["mask"], **kw)
        want.backward()
        m = train_step(actor.model, actor.optimizer, actor.scheduler, xs, actor.settings)
        got = [p.main_grad for p in actor.model[0].parameters()]
        assert m["actor/num_micro_batches"] >= 3
        assert m["actor/pg_loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
        for (name, p), g in zip(ref.named_parameters(), got):
            torch.testing.assert_close(g, p.grad, atol=1e-7, rtol=1e-4, msg=name)
        clipped = m["actor/pg_clipfrac_high"] + m["actor/pg_clipfrac_low"]
        assert 0 < clipped < 1  # the clip binds on part of the batch, so the comparison sees it
        hint = m["actor/grad_shortcut_used"]
        assert (hint > 0) if policy_loss == "cispo" else (hint == 0)
        assert m["actor/grad_shortcut_fallbacks"] == 0
    finally:
        destroy_parallel()
