"""Rollout correction through the Megatron train step (off_policy.correct_samples, then mcore/train_step.py),
one process, several micro-batches.

Reference: an importance weight w > 0 is a per-token constant that commutes with the clips (max / min of
-A * ratio terms keep their branch, the sign of A is kept), so the weighted loss equals the plain DAPO loss
with per-token advantages w * A; a rejected token is one whose loss mask is 0. The test computes the
weights and the rejections by hand from the samples, runs the train step on the corrected samples and on
the hand-made equivalents, and compares the gradients megatron's DDP accumulated (``main_grad``,
clip_grad = 0 so the optimizer leaves them alone) and the metrics.
"""

import dataclasses
import math

import pytest
import torch

from megatron_dapo.algo.rollout_correction import CorrectionSpec, parse_rejections
from megatron_dapo.batching import Sample
from megatron_dapo.config import LossConfig
from megatron_dapo.off_policy import correct_samples
from tests.helpers import policy
from tests.helpers.policy import one_process_cfg, tiny_hf_config

CAP = 2.0


def make_samples(actor) -> list[Sample]:
    """policy.make_samples's batch; old log-probs = the model's plus noise (ratios spread over the clip
    range); engine log-probs = old minus noise (weights on both sides of 1, some above the cap)."""
    from megatron_dapo.mcore.train_step import compute_log_probs

    xs = policy.make_samples(0, shapes=policy.SHAPES[:6])
    lps, _ = compute_log_probs(actor.model, xs, actor.settings)
    g = torch.Generator().manual_seed(1)
    out = []
    for x, lp in zip(xs, lps):
        old = lp + 0.3 * torch.randn(lp.shape, generator=g)
        out.append(dataclasses.replace(x, old_log_probs=old,
                                       rollout_log_probs=old - 0.8 * torch.randn(lp.shape, generator=g)))
    return out


def test_correction_through_the_train_step(monkeypatch):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import train_step

    monkeypatch.delenv("RANK", raising=False)  # a one-process gloo world
    try:
        actor = MegatronActor(one_process_cfg(LossConfig()), tiny_hf_config())
        module = actor.model[0].module
        w0 = {k: v.clone() for k, v in module.state_dict().items() if v is not None}
        xs = make_samples(actor)

        def run(samples):
            module.load_state_dict(w0, strict=False)  # every run's gradient at the same weights
            m = train_step(actor.model, actor.optimizer, actor.scheduler, samples, actor.settings)
            return m, [p.main_grad.detach().clone() for p in actor.model[0].parameters()]

        # Token TIS: the weights by hand, as per-token advantages w * A.
        tis, metrics = correct_samples(xs, CorrectionSpec(is_level="token", is_upper=CAP))
        weights = [torch.exp(x.old_log_probs - x.rollout_log_probs).clamp(max=CAP) for x in xs]
        masks = [torch.ones(x.num_response_tokens) if x.loss_mask is None else x.loss_mask for x in xs]
        for x, w, mk in zip(tis, weights, masks):
            torch.testing.assert_close(x.is_weights * mk, w * mk, atol=1e-6, rtol=1e-6)
        reweighted = [dataclasses.replace(x, advantages=x.advantages * w) for x, w in zip(xs, weights)]
        m_tis, g_tis = run(tis)
        m_ref, g_ref = run(reweighted)
        m_off, g_off = run(xs)
        assert m_tis["actor/num_micro_batches"] >= 3
        for got, want in zip(g_tis, g_ref):
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
        assert m_tis["actor/pg_loss"] == pytest.approx(m_ref["actor/pg_loss"], rel=1e-5, abs=1e-7)
        # ... and the weights matter here (so the comparison above can fail).
        diff = max((a - b).abs().max().item() for a, b in zip(g_tis, g_off))
        assert diff > 100 * max((a - b).abs().max().item() for a, b in zip(g_tis, g_ref))
        # The step's metrics, over the valid tokens of the batch.
        n = sum(float(mk.sum()) for mk in masks)
        above = sum(float(((torch.exp(x.old_log_probs - x.rollout_log_probs) > CAP) * mk).sum())
                    for x, mk in zip(xs, masks))
        assert metrics["rollout_corr/is_frac_high"] == pytest.approx(above / n, abs=1e-6)
        assert 0 < metrics["rollout_corr/is_frac_high"] < 1
        assert metrics["rollout_corr/is_mean"] == pytest.approx(
            sum(float((w * mk).sum()) for w, mk in zip(weights, masks)) / n, rel=1e-5)

        # Rejection: the tokens past the bound leave the loss and its token count.
        rules = parse_rejections("token_k2", 0.2)
        rejected, rm = correct_samples(xs, CorrectionSpec(rejections=rules))
        keep = [(0.5 * (x.old_log_probs - x.rollout_log_probs) ** 2 <= 0.2).float() * mk for x, mk in zip(xs, masks)]
        hand = [dataclasses.replace(x, loss_mask=k) for x, k in zip(xs, keep)]
        m_rej, g_rej = run(rejected)
        m_hand, g_hand = run(hand)
        assert m_rej["actor/num_tokens"] == m_hand["actor/num_tokens"] == sum(float(k.sum()) for k in keep) < n
        for got, want in zip(g_rej, g_hand):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert rm["rollout_corr/token_masked_frac"] == pytest.approx(1 - m_rej["actor/num_tokens"] / n, abs=1e-6)

        # An engine that agrees with the trainer: every weight is exactly 1, nothing changes.
        agree, am = correct_samples([dataclasses.replace(x, rollout_log_probs=x.old_log_probs.clone()) for x in xs],
                                    CorrectionSpec(is_level="token", is_upper=CAP))
        _, g_agree = run(agree)
        assert all(torch.equal(a, b) for a, b in zip(g_agree, g_off))
        assert am["rollout_corr/is_mean"] == 1.0 and math.isclose(am["rollout_corr/kl"], 0.0, abs_tol=0)

        # A sample without the engine's log-probs fails with the fix in the message.
        missing = xs[:2] + [dataclasses.replace(xs[2], rollout_log_probs=None)] + xs[3:]
        with pytest.raises(ValueError, match=r"samples \[2\] lack them.*rollout_is=null"):
            correct_samples(missing, CorrectionSpec(is_level="token"))
        assert correct_samples(missing, CorrectionSpec()) == (missing, {})  # off: not needed
    finally:
        destroy_parallel()
