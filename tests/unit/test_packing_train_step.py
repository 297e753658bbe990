"""Packed micro-batches through the Megatron train step, one process: the log-probs, the loss, its
metrics and the gradient equal the padded layout's (fp32 round-off) for token-mean, a per-sequence
mode and GSPO's sequence ratio; a sample's log-probs do not depend on the
sample packed before it (attention stays within a sample) and equal its own alone (its positions
restart)."""

import dataclasses

import pytest
import torch

from megatron_dapo.batching import Sample
from megatron_dapo.config import LossConfig
from tests.helpers import policy
from tests.helpers.policy import one_process_cfg, tiny_hf_config

pytestmark = pytest.mark.slow


@pytest.fixture
def actors(monkeypatch):
    """Build two actors (padded, packed) with the same weights: ``make(loss)``."""
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    monkeypatch.delenv("RANK", raising=False)  # a one-process gloo world

    def make(loss: LossConfig):
        cfg = one_process_cfg(loss)
        padded = MegatronActor(cfg, tiny_hf_config())
        packed = MegatronActor(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pack_sequences=True)),
                               tiny_hf_config(), initialize=False)
        packed.model[0].module.load_state_dict(padded.model[0].module.state_dict())
        assert packed.settings.pack_sequences and not padded.settings.pack_sequences
        return padded, packed

    yield make
    destroy_parallel()


def _with_old(actor, xs, seed):
    from megatron_dapo.mcore.train_step import compute_log_probs

    lps, _ = compute_log_probs(actor.model, xs, actor.settings)
    g = torch.Generator().manual_seed(seed)
    return [dataclasses.replace(x, old_log_probs=lp + 0.05 * torch.randn(lp.shape, generator=g))
            for x, lp in zip(xs, lps)]


@pytest.mark.parametrize("loss", [
    LossConfig(),  # dapo, token-mean: the output layer's gradient hint on packed positions
    LossConfig(loss_agg_mode="seq-mean-token-mean"),  # per sequence: the loss's rows are the samples
    LossConfig(policy_loss="gspo"),  # the sequence ratio over each sample's response
], ids=["token_mean", "seq_mean_token_mean", "gspo"])
def test_packed_update_equals_padded(actors, loss):
    from megatron_dapo.mcore.train_step import compute_log_probs, train_step

    padded, packed = actors(loss)
    xs = _with_old(padded, policy.make_samples(0), seed=1)
    for (a, b), what in zip(zip(*(compute_log_probs(x.model, xs, x.settings) for x in (padded, packed))),
                            ("log-probs", "entropy")):
        for i, (u, v) in enumerate(zip(a, b)):
            torch.testing.assert_close(v, u, atol=2e-6, rtol=1e-5, msg=f"{what} of sample {i}")
    m_pad = train_step(padded.model, padded.optimizer, padded.scheduler, xs, padded.settings)
    m_pack = train_step(packed.model, packed.optimizer, packed.scheduler, xs, packed.settings)
    assert m_pack["actor/num_micro_batches"] == 4  # 126 tokens in packs of the 40-token budget, several each
    for key, want in m_pad.items():
        if key not in ("actor/num_micro_batches", "actor/grad_shortcut_used"):
            assert m_pack[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert m_pack["actor/grad_shortcut_fallbacks"] == 0
    token_mean = packed.settings.loss_agg_mode == "token-mean" and packed.settings.policy_loss == "dapo"
    assert (m_pack["actor/grad_shortcut_used"] > 0) == (m_pad["actor/grad_shortcut_used"] > 0) == token_mean
    for (name, p), q in zip(padded.model[0].named_parameters(), packed.model[0].parameters()):
        torch.testing.assert_close(q.main_grad, p.main_grad, atol=1e-7, rtol=1e-4, msg=name)


def test_a_packed_sample_sees_neither_its_neighbour_nor_its_offset(actors):
    from megatron_dapo.mcore.train_step import compute_log_probs

    padded, packed = actors(LossConfig())
    g = torch.Generator().manual_seed(3)
    first, second = (Sample(prompt_ids=torch.randint(0, 100, (p,), generator=g),
                            response_ids=torch.randint(0, 100, (r,), generator=g)) for p, r in ((6, 9), (5, 12)))
    other = dataclasses.replace(first, prompt_ids=torch.randint(0, 100, (6,), generator=g),
                                response_ids=torch.randint(0, 100, (9,), generator=g))
    after_first, _ = compute_log_probs(packed.model, [first, second], packed.settings)  # one pack of 32 tokens
    after_other, _ = compute_log_probs(packed.model, [other, second], packed.settings)
    alone, _ = compute_log_probs(padded.model, [second], padded.settings)
    torch.testing.assert_close(after_first[1], after_other[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(after_first[1], alone[0], atol=2e-6, rtol=1e-5)
    assert (after_first[0] - after_other[0]).abs().max() > 0.1  # the first samples do differ


def test_packing_is_refused_where_it_has_not_run():
    from megatron_dapo.errors import ConfigError
    from megatron_dapo.mcore.parallel import check_packing

    check_packing(transformer_impl="local")  # dense or MoE, any layout (expert parallelism included)
    with pytest.raises(ConfigError, match="with the Transformer Engine spec .*train.pack_sequences=false"):
        check_packing(transformer_impl="transformer_engine")
