"""actor.offload_during_rollout at DP=2 (2 gloo processes): each rank moves its own share, and training
with offload equals training without it, bit for bit, on every rank.

With the distributed optimizer each rank holds half of the Adam moments (and of the fp32 main params),
so each rank's offload moves half of what one process moves; the DDP buffers are whole on every rank.
The single-process checks (what moves, the same objects back, the deliberate breaks) are
tests/unit/test_offload.py; this one adds the sharded layout and the collectives around it (DDP's
reduce-scatter and the param all-gather run on re-allocated buffers).
"""

import dataclasses

import pytest
import torch

from tests.distributed.harness import spawn
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, UPDATES = 3, 2


def _run(dist_opt: bool, offload: bool) -> tuple[dict, list, list]:
    """(state after STEPS steps, metrics, offload byte counts per step) of a fresh bf16 actor."""
    from megatron_dapo.config import ActorConfig, ModelConfig
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    cfg = tiny_cfg(dist_opt=dist_opt)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype="bf16"),
                              actor=ActorConfig(offload_during_rollout=offload, offload_weights=offload))
    actor = MegatronActor(cfg, tiny_hf_config())
    metrics, moved = [], []
    for step in range(STEPS):
        if offload:
            sizes = [s.nbytes() for ss in actor.offloader.storages().values() for s in ss]
            moved.append(actor.offloader.offload())
            junk = [torch.full((n,), 255, dtype=torch.uint8) for n in sizes]  # the freed memory gets reused
            junk.clear()
            actor.onload_after_rollout()
        xs = with_actor_log_probs(actor, make_samples(step), seed=100 + step)
        size = len(xs) // UPDATES
        metrics += [actor.get_loss_and_metrics(xs[i:i + size]) for i in range(0, len(xs), size)]
    state = {f"w:{n}": p.detach().clone() for n, p in actor.model[0].named_parameters()}
    for i, opt in enumerate(o.optimizer for o in actor.optimizer.chained_optimizers):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                state[f"main:{i}.{g}.{j}"] = p.detach().clone()
                state.update({f"state:{i}.{g}.{j}.{k}": v.clone() for k, v in opt.state.get(p, {}).items()})
    destroy_parallel(process_group=False)
    return state, metrics, moved


def _worker(rank):
    for dist_opt in (True, False):
        got, got_metrics, moved = _run(dist_opt, offload=True)
        want, want_metrics, _ = _run(dist_opt, offload=False)
        what = f"rank {rank}, DP=2, distributed optimizer {dist_opt}"
        assert got.keys() == want.keys() and any(k.startswith("state:") for k in got), what
        differ = [k for k in want if not torch.equal(got[k], want[k])]
        assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:4]}"
        assert got_metrics == want_metrics, what
        # This rank's share: fp32 main params (4 bytes) + Adam m, v (8 bytes) per parameter it owns.
        owned = sum(p.numel() for k, p in want.items() if k.startswith("main:"))
        n = sum(p.numel() for k, p in want.items() if k.startswith("w:"))
        assert moved[-1].optimizer_bytes == 12 * owned, what
        assert (owned < 0.6 * n) if dist_opt else (owned == n), (what, owned, n)


def test_dp2_training_with_offload_equals_training_without():
    spawn(_worker)
