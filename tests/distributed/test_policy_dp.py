"""Data parallelism: DP=2 with unequal token counts per rank makes the same update as one process.

Each of the 2 gloo ranks trains on its own part of an 8-sample mini-batch; rank 0 holds the two
longest responses, rank 1 six shorter ones, so the ranks hold different numbers of valid tokens
(37 and 44) and, under the token budget, of micro-batches (2 and 3: rank 0 pads with an empty one). The
reference (each rank, redundantly) is the plain-torch update of tests/helpers/reference.py on the
whole batch: token-mean over all 8 samples, clip, AdamW. After one megatron step (DDP + finalize
+ optimizer, distributed optimizer on and off, and packed: 2 and 3 packs) the parameters equal the
reference's.

The test can fail: a per-rank token-mean averaged over the ranks (what dividing by the local
count gives under DDP's averaging) makes a measurably different update, checked here too.
"""

import dataclasses

import pytest
import torch

from megatron_dapo.batching import make_micro_batches
from tests.distributed.harness import assert_close, full_params, load_full, spawn
from tests.helpers.policy import LR, make_samples, tiny_cfg, tiny_hf_config, unwrap
from tests.helpers.reference import dapo_loss, reference_update, with_old_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SHARDS = ([3, 6], [0, 1, 2, 4, 5, 7])  # sample indices per DP rank: the longest responses on rank 0


def _worker(rank):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import build_model, destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import train_step

    hf = tiny_hf_config()
    for dist_opt, packed in ((True, False), (False, False), (True, True)):
        cfg = tiny_cfg(dist_opt=dist_opt)
        actor = MegatronActor(cfg, hf)
        actor.settings = dataclasses.replace(actor.settings, pack_sequences=packed)
        assert ps.get_data_parallel_world_size() == 2
        model = unwrap(actor.model[0])
        w0 = full_params([model])  # DP rank 0's initial weights (DDP broadcast them)
        ref, per_rank = (build_model(hf, model=cfg.model, parallel=cfg.parallel)[0] for _ in range(2))
        load_full([ref], w0, 0, 1)
        load_full([per_rank], w0, 0, 1)
        xs = with_old_log_probs(ref, make_samples(0), seed=1)

        local = [xs[i] for i in SHARDS[rank]]
        tokens = [sum(xs[i].num_response_tokens if xs[i].loss_mask is None else float(xs[i].loss_mask.sum())
                      for i in shard) for shard in SHARDS]
        plans = [len(make_micro_batches([xs[i] for i in shard], max_tokens=40, micro_batch_size=1, packed=packed))
                 for shard in SHARDS]
        assert tokens[0] != tokens[1] and plans[0] != plans[1], (tokens, plans)

        m = train_step(actor.model, actor.optimizer, actor.scheduler, local, actor.settings)
        want = reference_update(ref, xs, lr=LR / 2)
        # A per-rank token-mean, averaged over the 2 ranks: the variant that is wrong here.
        reference_update(per_rank, xs, lr=LR / 2, loss_fn=lambda fw: 0.5 * sum(
            dapo_loss(fw, rows=shard)[0] for shard in SHARDS))

        assert m["actor/num_micro_batches"] == max(plans)
        assert m["actor/num_tokens"] == sum(tokens) == want["num_tokens"]
        what = f"DP=2 (distributed optimizer {dist_opt}{', packed' if packed else ''})"
        assert_close(torch.tensor(m["actor/pg_loss"]), want["loss"], f"{what}: loss")
        assert_close(torch.tensor(m["actor/grad_norm"]), want["grad_norm"], f"{what}: grad norm")
        assert_close(torch.tensor(m["actor/entropy"]), want["entropy"], f"{what}: entropy")
        got, ref_w, wrong_w = full_params([model]), full_params([ref]), full_params([per_rank])
        for name in w0:
            assert_close(got[name], ref_w[name], f"{what}: {name} after the update", atol=1e-6, rtol=1e-5)
        gap = max((wrong_w[n] - ref_w[n]).abs().max() for n in w0)
        assert gap > 1e-4, f"the per-rank mean should move the weights differently (max diff {gap})"
        destroy_parallel(process_group=False)


def test_dp2_unequal_tokens_equals_one_process():
    spawn(_worker)
