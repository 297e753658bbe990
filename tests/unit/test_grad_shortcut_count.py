"""Counting the fused output layer's gradient shortcut (mcore/logprobs.py ``SHORTCUT_STATS``) and
its per-update metrics (mcore/train_step.py): a fallback to the recompute is exact, so without
the count it would go unnoticed (it only costs time)."""

import dataclasses

import pytest
import torch

from megatron_dapo.mcore import logprobs
from megatron_dapo.mcore.logprobs import SHORTCUT_STATS, GradHint, vocab_parallel_logprobs_from_hidden
from tests.helpers.policy import hint_case, make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs


def _counts_after(loss_of, *, with_hint=True) -> logprobs.ShortcutStats:
    """The counter's change over one forward + backward of the fused output layer."""
    hidden, weight, target, active, w = hint_case()
    flat_w = w.reshape(-1)
    hint = GradHint(grad=lambda index, lp: flat_w[index] * 3.0, active=active) if with_hint else None
    before = SHORTCUT_STATS.snapshot()
    lp, h = vocab_parallel_logprobs_from_hidden(hidden, weight, target, temperature=0.8, valid_vocab_size=36,
                                                chunk_tokens=4, grad_hint=hint)
    torch.autograd.grad(loss_of(lp, h, w), (hidden, weight))
    return SHORTCUT_STATS.since(before)


def test_shortcut_used_when_the_gradient_is_the_hint_times_a_scalar():
    predicted = lambda lp, h, w: 0.37 * (lp * w).sum()  # the hint times a loss scale
    assert _counts_after(predicted) == logprobs.ShortcutStats(used=1, fallbacks=0)


@pytest.mark.parametrize("surprise", [
    lambda lp, h, w: (lp * w).sum() + 0.1 * (h * w).sum(),  # an entropy gradient
    lambda lp, h, w: (lp * w.flip(0)).sum(),  # not a multiple of the hint
])
def test_fallback_counted_when_the_hint_does_not_hold(surprise):
    assert _counts_after(surprise) == logprobs.ShortcutStats(used=0, fallbacks=1)


def test_no_hint_counts_neither():
    assert _counts_after(lambda lp, h, w: (lp * w).sum(), with_hint=False) == logprobs.ShortcutStats()


def test_reset_and_snapshot():
    stats = logprobs.ShortcutStats()
    stats.record(used=True)
    snap = stats.snapshot()
    stats.record(used=False)
    assert (snap.used, snap.fallbacks) == (1, 0)  # a copy
    assert stats.since(snap) == logprobs.ShortcutStats(used=0, fallbacks=1)
    stats.reset()
    assert stats == logprobs.ShortcutStats()


def test_update_metrics_report_the_counts(world_of_one, monkeypatch):
    """Through a real (tiny, CPU) update: a hint that does not match the loss falls back in every
    micro-batch; the real one (token-mean) takes the shortcut in every micro-batch; no hint
    (seq-mean) counts 0. The wrong hint goes first: after an update most tokens are clipped
    (gradient 0), and a micro-batch with one token left is a multiple of any hint."""
    from megatron_dapo.mcore import train_step
    from megatron_dapo.mcore.actor import MegatronActor

    actor = MegatronActor(tiny_cfg(), tiny_hf_config())
    xs = with_actor_log_probs(actor, make_samples(0)[:4], seed=1)
    real = train_step._loss_grad_hint

    def wrong_hint(*args):  # every other position's gradient doubled: not a multiple of the real one
        hint = real(*args)
        return dataclasses.replace(hint, grad=lambda index, lp: hint.grad(index, lp) * (1 + index % 2))

    monkeypatch.setattr(train_step, "_loss_grad_hint", wrong_hint)
    m = actor.get_loss_and_metrics(xs)
    assert m["actor/num_micro_batches"] > 1
    assert m["actor/grad_shortcut_used"] == 0
    assert m["actor/grad_shortcut_fallbacks"] == m["actor/num_micro_batches"]

    monkeypatch.setattr(train_step, "_loss_grad_hint", real)
    m = actor.get_loss_and_metrics(xs)
    assert m["actor/grad_shortcut_used"] == m["actor/num_micro_batches"]
    assert m["actor/grad_shortcut_fallbacks"] == 0

    actor.settings = dataclasses.replace(actor.settings, loss_agg_mode="seq-mean-token-mean")
    m = actor.get_loss_and_metrics(xs)
    assert m["actor/grad_shortcut_used"] == m["actor/grad_shortcut_fallbacks"] == 0
