"""The fused output layer's gradients come from the forward in a real DAPO update (mcore/logprobs.py,
``GradHint``; mcore/train_step.py, ``_loss_grad_hint``): for the token-mean loss the hint holds and
backward recomputes no chunk of logits; for a seq-mean mode (no hint) it recomputes. The values of
the hinted update are checked against HF by tests/distributed/test_policy_train_step.py; here,
that the saving really happens, and that both paths give the same update."""

import dataclasses

import pytest
import torch

from tests.helpers.policy import ODD, bf16_actor, bf16_hf_dir, make_samples, with_actor_log_probs


@pytest.fixture
def recomputed(monkeypatch):
    from megatron_dapo.mcore import logprob_chunks

    calls, real = [], logprob_chunks.chunk_backward
    monkeypatch.setattr(logprob_chunks, "chunk_backward", lambda *a: calls.append(1) or real(*a))
    return calls


def test_token_mean_update_recomputes_nothing(world_of_one, recomputed, tmp_path, monkeypatch):
    from megatron_dapo.mcore import train_step

    actor = bf16_actor(bf16_hf_dir(tmp_path), transformer_impl="local")
    xs = with_actor_log_probs(actor, make_samples(0, shapes=ODD), seed=1)
    state = {n: p.detach().clone() for n, p in actor.model[0].named_parameters()}
    hinted = actor.get_loss_and_metrics(xs)
    assert not recomputed

    # the same update without the hint, from the same weights: recomputed in backward, the same
    # loss and gradient norm (both taken before the optimizer step, so its state does not matter)
    with torch.no_grad():
        for n, p in actor.model[0].named_parameters():
            p.copy_(state[n])
    actor.optimizer.reload_model_params()  # the distributed optimizer's fp32 copies from the params
    monkeypatch.setattr(train_step, "_loss_grad_hint", lambda *a: None)
    plain = actor.get_loss_and_metrics(xs)
    assert recomputed
    assert plain["actor/pg_loss"] == pytest.approx(hinted["actor/pg_loss"], abs=1e-6)
    assert plain["actor/grad_norm"] == pytest.approx(hinted["actor/grad_norm"], rel=1e-4)


def test_seq_mean_update_recomputes(world_of_one, recomputed, tmp_path):
    actor = bf16_actor(bf16_hf_dir(tmp_path), transformer_impl="local")
    actor.settings = dataclasses.replace(actor.settings, loss_agg_mode="seq-mean-token-mean")
    xs = with_actor_log_probs(actor, make_samples(0, shapes=ODD), seed=1)
    actor.get_loss_and_metrics(xs)
    assert recomputed
