"""megatron-core's router losses on a tiny Qwen3-MoE (tests/helpers/moe.py's shape, 4 experts top-2,
load-balancing loss on) in one process: padding (rows and columns, marked by GPTModel's padding_mask,
True = padding) leaves the tracked load-balancing loss unchanged, in the model's forward and through
the train step (mcore/train_step.py passes batching.padding_mask); and mcore.moe.router_losses is the
mean over layers and micro-batches of what megatron's tracker recorded.

One MegatronActor per module (``actor``); each test reads or restores its weights."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.config import (
    DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, RewardConfig, RolloutConfig, TrainConfig,
)
from megatron_dapo.config_moe import MoEConfig
from tests.helpers import policy
from tests.helpers.moe import TINY_MOE

VOCAB = TINY_MOE["vocab_size"]
HF = {**TINY_MOE, "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
      "max_position_embeddings": 128, "norm_topk_prob": True, "router_aux_loss_coef": 0.001}
# 6 samples in micro-batches of 4 rows: 2 micro-batches, ragged rows in each
CFG = DAPOConfig(
    seed=1, model=ModelConfig(make_vocab_size_divisible_by=64), moe=MoEConfig(load_balancing="aux_loss"),
    data=DataConfig(prompts_per_step=4, gen_prompts_per_batch=4, max_prompt_length=8),
    rollout=RolloutConfig(temperature=0.8, max_response_length=24),
    reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
    train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=0, micro_batch_size=4),
    optim=OptimConfig(lr=1e-3, lr_warmup_steps=0, clip_grad=0.0))


@pytest.fixture(scope="module")
def actor():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)  # a one-process gloo world
        try:
            actor = MegatronActor(CFG, HF)
            with torch.no_grad():  # routing far from ties, so that a token more or less moves the loss
                for name, p in policy.unwrap(actor.model[0]).named_parameters():
                    if name.endswith("router.weight"):
                        p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
            yield actor
        finally:
            get_moe_metrics_tracker().clear()
            destroy_parallel()


def _tracked(model, ids, padding_mask):
    """The per-layer load-balancing loss (before its coefficient) megatron's tracker records for one
    training forward of ``ids``; the tracker is left empty."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    model.train()
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, padding_mask=padding_mask)
    values = tracker.metrics["load_balancing_loss"].values.clone()
    tracker.clear()
    return values, logits.detach()


def test_padding_rows_and_columns_leave_the_load_balancing_loss_unchanged(actor):
    """Two samples of 10 tokens as one [2, 10] micro-batch (no padding), and as a [4, 16] one (two padding
    rows, six padding columns: batching.build_micro_batch's shape), each with batching.padding_mask."""
    from megatron_dapo.batching import build_micro_batch, padding_mask

    model = policy.unwrap(actor.model[0])
    xs = policy.make_samples(0, shapes=[(3, 7), (6, 4)], vocab=VOCAB)
    tight, padded = build_micro_batch(xs, [0, 1]), build_micro_batch(xs, [0, 1], shape=(4, 16))
    assert tight.input_ids.shape == (2, 10) and not padding_mask(tight).any()
    assert padding_mask(padded).sum() == 4 * 16 - 2 * 10
    want, logits = _tracked(model, tight.input_ids, padding_mask(tight))
    torch.testing.assert_close(_tracked(model, tight.input_ids, None)[0], want, rtol=1e-6, atol=0)  # no padding
    got, padded_logits = _tracked(model, padded.input_ids, padding_mask(padded))
    torch.testing.assert_close(padded_logits[:2, :10], logits, rtol=0, atol=1e-6)  # the same tokens' states
    assert got.shape == (2,) and (got > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    unmasked, _ = _tracked(model, padded.input_ids, None)
    assert (unmasked - want).abs().max() > 1e-3  # the comparison can fail: padding, counted, moves it


def _samples(model_actor):
    from megatron_dapo.mcore.train_step import compute_log_probs

    xs = policy.make_samples(0, shapes=policy.SHAPES[:6], vocab=VOCAB)
    lps, _ = compute_log_probs(model_actor.model, xs, model_actor.settings)
    return [dataclasses.replace(x, old_log_probs=lp) for x, lp in zip(xs, lps)]


def _restore(actor, weights):
    with torch.no_grad():
        for p, w in zip(actor.model[0].parameters(), weights):
            p.copy_(w)
    actor.optimizer.reload_model_params()


def test_the_train_step_keeps_padding_out_of_the_load_balancing_loss(actor):
    """The same samples in the same two micro-batches, padded to the longest row (pad_multiple=1) and to a
    multiple of 16 (more padding columns): the update's moe/load_balancing_loss is the same."""
    from megatron_dapo.mcore.train_step import train_step

    xs = _samples(actor)
    weights = [p.detach().clone() for p in actor.model[0].parameters()]
    got = {}
    for multiple in (1, 16):
        _restore(actor, weights)
        settings = dataclasses.replace(actor.settings, pad_multiple=multiple)
        m = train_step(actor.model, actor.optimizer, actor.scheduler, xs, settings)
        assert m["actor/num_micro_batches"] == 2
        got[multiple] = float(m["moe/load_balancing_loss"])
    _restore(actor, weights)
    assert got[1] > 0
    assert got[16] == pytest.approx(got[1], rel=1e-6)


def test_router_losses_is_the_mean_over_layers_and_micro_batches(actor):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_dapo.mcore.moe import router_losses

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    values = {"load_balancing_loss": [[1.0, 2.0], [4.0, 8.0]], "z_loss": [[0.5, 0.25], [0.0, 1.0]]}  # [mb][layer]
    for name, per_mb in values.items():
        for per_layer in per_mb:  # what the router records on each micro-batch's forward
            for layer, v in enumerate(per_layer, start=1):
                tracker.record(name, torch.tensor(v), layer_number=layer, num_layers=2)
    config = SimpleNamespace(num_layers=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
                             moe_z_loss_coeff=1e-4)
    out = router_losses(config, real_microbatches=2, microbatches=2, device="cpu")
    assert set(out) == {"moe/load_balancing_loss", "moe/z_loss"}
    assert out["moe/load_balancing_loss"].item() == pytest.approx(15.0 / 4)
    assert out["moe/z_loss"].item() == pytest.approx(1.75 / 4)
    assert all(not e.values.any() for e in tracker.metrics.values())  # cleared (zeroed) for the next update
    tracker.record("load_balancing_loss", torch.tensor(3.0), layer_number=1, num_layers=2)
    off = SimpleNamespace(num_layers=2, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                          moe_z_loss_coeff=None)
    assert router_losses(off, real_microbatches=1, microbatches=1, device="cpu") == {}  # nothing on, nothing logged
    assert all(not e.values.any() for e in tracker.metrics.values())


def test_an_all_padding_micro_batch_adds_no_nan(actor):
    """One DP rank needing 3 micro-batches where this one needs 2 (counts_table: what batch_counts would
    gather from it) makes this rank run an all-padding third one."""
    from megatron_dapo.mcore.micro_batches import batch_counts
    from megatron_dapo.mcore.train_step import train_step

    xs = _samples(actor)
    weights = [p.detach().clone() for p in actor.model[0].parameters()]
    table = batch_counts(actor.model, [xs], actor.settings)[0]
    table[:, 2] = 3  # the micro-batch count the busiest DP rank needs
    try:
        m = train_step(actor.model, actor.optimizer, actor.scheduler, xs, actor.settings, counts_table=table)
        assert m["actor/num_micro_batches"] == 3
        assert torch.isfinite(torch.as_tensor(m["moe/load_balancing_loss"]))
        assert torch.isfinite(torch.as_tensor(m["actor/grad_norm"]))
    finally:
        _restore(actor, weights)


def test_packed_micro_batches_make_the_padded_update_with_the_router_losses(actor):
    """The same micro-batches of 4 samples (no budget), padded rows against packed ones
    (train.pack_sequences), both to a multiple of 16 (a packed row ends in padding too): the router's
    load-balancing loss (padding kept out of it either way), the policy metrics and every gradient are
    the same."""
    from megatron_dapo.mcore.train_step import train_step

    xs = _samples(actor)
    weights = [p.detach().clone() for p in actor.model[0].parameters()]
    got = {}
    for packed in (False, True):
        _restore(actor, weights)
        settings = dataclasses.replace(actor.settings, pack_sequences=packed, pad_multiple=16)
        m = train_step(actor.model, actor.optimizer, actor.scheduler, xs, settings)
        got[packed] = m, [p.main_grad.clone() for p in actor.model[0].parameters()]
    _restore(actor, weights)
    (m_pad, g_pad), (m_pack, g_pack) = got[False], got[True]
    assert m_pad["moe/load_balancing_loss"] > 0 and m_pack["actor/num_micro_batches"] == 2
    for key, want in m_pad.items():
        assert m_pack[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    for (name, _), a, b in zip(policy.unwrap(actor.model[0]).named_parameters(), g_pad, g_pack):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-4, msg=name)
