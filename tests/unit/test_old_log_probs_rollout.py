"""train.old_log_probs=rollout: the engine's log-probs are pi_old and the engine/trainer mismatch is
measured inside the first update's forward (mcore/train_step.py ``mismatch=True``), one process.

Reference: the trainer's own forward-only pass at the same weights (compute_log_probs, the
old-log-prob pass of train.old_log_probs=trainer) fed to weight_sync.logprob_mismatch, the function
the loop calls after that pass. Several micro-batches (a token budget) so the partial sums are reduced.
"""

import dataclasses

import pytest
import torch

from megatron_dapo.config_loading import load_config
from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.weight_sync import MISMATCH_KEYS, logprob_mismatch
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs


def test_the_mismatch_measured_in_an_update_equals_the_pass_then_logprob_mismatch(monkeypatch):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import compute_log_probs

    monkeypatch.delenv("RANK", raising=False)  # a one-process gloo world
    try:
        actor = MegatronActor(tiny_cfg(), tiny_hf_config())  # a 40-token budget: several micro-batches
        # rollout log-probs = the model's + noise: a mismatch well above 1 (old ones: the same, unused here)
        xs = [dataclasses.replace(x, rollout_log_probs=x.old_log_probs)
              for x in with_actor_log_probs(actor, make_samples(0), seed=1)]
        trainer, _ = compute_log_probs(actor.model, xs, actor.settings)
        pad = torch.nn.utils.rnn.pad_sequence
        want = logprob_mismatch(pad([x.rollout_log_probs for x in xs], batch_first=True),
                                pad(trainer, batch_first=True),
                                pad([torch.ones(x.num_response_tokens) for x in xs], batch_first=True))
        got = actor.get_loss_and_metrics(xs, mismatch=True)  # the update's forward: the same weights
        assert got["actor/num_micro_batches"] >= 3
        for key in MISMATCH_KEYS:
            assert got[key] == pytest.approx(float(want[key]), rel=1e-5), key
        assert got["rollout/logprob_mismatch"] > 1.1  # not the trivial 1.0 of an agreeing engine
        assert not any(k.startswith("rollout/_") for k in got)  # the partial sums are not reported
        assert not set(MISMATCH_KEYS) & set(actor.get_loss_and_metrics(xs))  # only when asked
        with pytest.raises(ValueError, match=r"samples \[1\] have no rollout_log_probs"):
            actor.get_loss_and_metrics([xs[0], dataclasses.replace(xs[1], rollout_log_probs=None)], mismatch=True)
    finally:
        destroy_parallel()


def test_the_setting_is_checked_before_any_work(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("{}\n")
    assert load_config(base, ["train.old_log_probs=rollout"]).train.old_log_probs == "rollout"
    with pytest.raises(ConfigError, match="train.old_log_probs must be one of trainer, rollout"):
        load_config(base, ["train.old_log_probs=engine"])
    with pytest.raises(ConfigError, match="verl's bypass mode"):
        load_config(base, ["train.old_log_probs=rollout", "algorithm.rollout_correction.rollout_is=token"])
