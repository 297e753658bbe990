"""A step's exchanges made once for all its updates, as the loop does (the token counts gathered
ahead by ``batch_counts`` and passed as ``counts_table``; the metrics deferred with
``defer_metrics`` and reduced by ``reduce_metrics``), equal each update's own exchanges, bit for
bit, at DP=2 with unequal shares per rank.

Each rank builds the same actor twice (same seed, so the same initial weights) and makes the same
three updates on its own share: the first with the engine/trainer mismatch (its extra sum and max
keys make the updates' layouts differ), then two plain ones. Run A reduces each update as it
returns (the reference: tests/distributed/test_policy_dp.py checks that path against a plain-torch
update); run B gathers the three tables of counts in one call, and reduces the three updates'
metrics in one call. Every metric of every update must be
the same float, and the weights after the updates the same tensors.
"""

import dataclasses

import pytest
import torch

from tests.distributed.harness import full_params, spawn
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, unwrap
from tests.helpers.reference import with_old_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SHARDS = ([3, 6], [0, 1, 2, 4, 5, 7])  # unequal tokens and micro-batch counts per DP rank


def _updates(actor, xs, rank: int, defer: bool) -> list[dict]:
    from megatron_dapo.mcore.micro_batches import batch_counts
    from megatron_dapo.mcore.step_metrics import reduce_metrics
    from megatron_dapo.mcore.train_step import train_step

    local = [xs[i] for i in SHARDS[rank]]
    plan = [(local, True), (local[::-1], False), (local[:1], False)]
    tables = batch_counts(actor.model, [batch for batch, _ in plan], actor.settings) if defer else [None] * 3
    got = [train_step(actor.model, actor.optimizer, actor.scheduler, batch, actor.settings,
                      mismatch=mismatch, defer_metrics=defer, counts_table=table)
           for (batch, mismatch), table in zip(plan, tables)]
    return reduce_metrics(got) if defer else got


def _worker(rank):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    hf = tiny_hf_config()
    results, weights = [], []
    for defer in (False, True):
        actor = MegatronActor(tiny_cfg(), hf)
        model = unwrap(actor.model[0])
        xs = _with_pi_old(with_old_log_probs(model, make_samples(0), seed=1))
        results.append(_updates(actor, xs, rank, defer))
        weights.append(full_params([model]))
        destroy_parallel(process_group=False)
    each, once = results
    assert len(each) == len(once) == 3
    assert "rollout/logprob_mismatch" in once[0] and "rollout/logprob_mismatch" not in once[1]
    for k, (a, b) in enumerate(zip(each, once)):
        assert list(a) == list(b), (k, list(a), list(b))  # the same keys in the same order
        assert a == b, (k, {key: (a[key], b[key]) for key in a if a[key] != b[key]})
    assert each[0]["actor/num_tokens"] != each[2]["actor/num_tokens"]  # the updates differ
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def _with_pi_old(xs):
    """The engine's log-probs for the mismatch: pi_old shifted, by a different amount per sample."""
    return [dataclasses.replace(x, rollout_log_probs=x.old_log_probs + 0.01 * (i % 3))
            for i, x in enumerate(xs)]


def test_one_exchange_per_step_equals_one_per_update():
    """(The counts differ across the three updates: the third has one sample per rank.)"""
    spawn(_worker)
