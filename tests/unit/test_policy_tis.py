"""Truncated importance sampling through the Megatron train step (mcore/train_step.py), one process.

Reference: w = min(pi_old / pi_rollout, tis_cap) is a positive per-token constant, and a positive
factor commutes with the clips (max / min of -A * ratio terms keep their branch, the sign of A is
kept), so the TIS loss equals the plain DAPO loss with per-token advantages w * A. The test computes
w by hand from the samples, runs the train step once with TIS on and the engine's log-probs, once
with TIS off and the advantages pre-multiplied by w, and compares the gradients megatron's DDP
accumulated (``main_grad``, clip_grad = 0 so the optimizer leaves them alone) and the metrics.
"""

import dataclasses

import pytest
import torch

from megatron_dapo.config import DAPOConfig, LossConfig
from megatron_dapo.batching import Sample
from tests.helpers.policy import VOCAB, one_process_cfg, tiny_hf_config

CAP = 2.0
SHAPES = [(3, 9), (5, 14), (2, 6), (7, 20), (4, 11), (6, 3)]  # (prompt, response)


def tiny_cfg(tis_cap) -> DAPOConfig:
    return one_process_cfg(LossConfig(tis_cap=tis_cap))


def make_samples(actor) -> list[Sample]:
    """Random ids; advantages of both signs; one partial loss mask; old log-probs = the model's plus
    noise (ratios spread over the clip range); engine log-probs = old minus noise (weights on both
    sides of 1, some above the cap)."""
    from megatron_dapo.mcore.train_step import compute_log_probs

    g = torch.Generator().manual_seed(0)
    xs = []
    for i, (p, r) in enumerate(SHAPES):
        mask = (torch.arange(r) < r // 2).float() if i == 1 else None
        xs.append(Sample(prompt_ids=torch.randint(0, VOCAB, (p,), generator=g),
                         response_ids=torch.randint(0, VOCAB, (r,), generator=g),
                         advantages=float(torch.randn((), generator=g)), loss_mask=mask))
    lps, _ = compute_log_probs(actor.model, xs, actor.settings)
    out = []
    for x, lp in zip(xs, lps):
        old = lp + 0.3 * torch.randn(lp.shape, generator=g)
        out.append(dataclasses.replace(x, old_log_probs=old,
                                       rollout_log_probs=old - 0.8 * torch.randn(lp.shape, generator=g)))
    return out


def step(actor, xs, settings) -> tuple[dict, list[torch.Tensor]]:
    from megatron_dapo.mcore.train_step import train_step

    m = train_step(actor.model, actor.optimizer, actor.scheduler, xs, settings)
    return m, [p.main_grad.detach().clone() for p in actor.model[0].parameters()]


def test_tis_train_step_equals_advantages_times_the_weight(monkeypatch):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    monkeypatch.delenv("RANK", raising=False)  # a one-process gloo world
    try:
        actor = MegatronActor(tiny_cfg(CAP), tiny_hf_config())
        tis = actor.settings
        assert tis.tis_cap == CAP  # from loss.tis_cap
        plain = dataclasses.replace(tis, tis_cap=None)
        module = actor.model[0].module
        w0 = {k: v.clone() for k, v in module.state_dict().items() if v is not None}
        xs = make_samples(actor)

        def run(samples, settings):
            module.load_state_dict(w0, strict=False)  # every run's gradient at the same weights
            return step(actor, samples, settings)

        # The reference weighting, by hand: per-token advantages w * A.
        weights = [torch.exp(x.old_log_probs - x.rollout_log_probs).clamp(max=CAP) for x in xs]
        reweighted = [dataclasses.replace(x, advantages=x.advantages * w) for x, w in zip(xs, weights)]
        m_tis, g_tis = run(xs, tis)
        m_ref, g_ref = run(reweighted, plain)
        m_off, g_off = run(xs, plain)
        assert m_tis["actor/num_micro_batches"] >= 3
        for got, want in zip(g_tis, g_ref):
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
        assert m_tis["actor/pg_loss"] == pytest.approx(m_ref["actor/pg_loss"], rel=1e-5, abs=1e-7)
        assert m_tis["actor/grad_norm"] == pytest.approx(m_ref["actor/grad_norm"], rel=1e-5)
        # ... and TIS matters here (so the comparison above can fail).
        diff = max((a - b).abs().max().item() for a, b in zip(g_tis, g_off))
        assert diff > 100 * max((a - b).abs().max().item() for a, b in zip(g_tis, g_ref))
        assert abs(m_tis["actor/grad_norm"] - m_off["actor/grad_norm"]) > 1e-3 * m_off["actor/grad_norm"]

        # The TIS metrics: mini-batch token-means over the valid tokens.
        masks = [torch.ones(x.num_response_tokens) if x.loss_mask is None else x.loss_mask for x in xs]
        n = sum(float(mk.sum()) for mk in masks)
        above = sum(float(((torch.exp(x.old_log_probs - x.rollout_log_probs) > CAP) * mk).sum())
                    for x, mk in zip(xs, masks))
        assert m_tis["actor/tis_clip_frac"] == pytest.approx(above / n, abs=1e-6)
        assert m_tis["actor/tis_weight_mean"] == pytest.approx(
            sum(float((w * mk).sum()) for w, mk in zip(weights, masks)) / n, rel=1e-5)
        assert 0 < m_tis["actor/tis_clip_frac"] < 1 and "actor/tis_clip_frac" not in m_off

        # An engine that agrees with the trainer: every weight is exactly 1, TIS changes nothing.
        agree = [dataclasses.replace(x, rollout_log_probs=x.old_log_probs.clone()) for x in xs]
        m_agree, g_agree = run(agree, tis)
        assert all(torch.equal(a, b) for a, b in zip(g_agree, g_off))
        assert m_agree["actor/tis_weight_mean"] == pytest.approx(1.0) and m_agree["actor/tis_clip_frac"] == 0

        # A sample without the engine's log-probs fails with the fix in the message.
        missing = xs[:2] + [dataclasses.replace(xs[2], rollout_log_probs=None)] + xs[3:]
        with pytest.raises(ValueError, match=r"1 samples of the mini-batch have no rollout_log_probs "
                                             r"\(here: samples \[2\].*loss.tis_cap=null"):
            step(actor, missing, tis)
        step(actor, missing, plain)  # TIS off: not needed
    finally:
        destroy_parallel()
