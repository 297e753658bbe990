"""Checkpoints (mcore/checkpoint.py): saved at TP=2, resumed at TP=1 x DP=2 and at PP=2.

The uninterrupted run (TP=2) takes update 1, saves, takes update 2 and records its loss, grad
norm, lr and weights (full HF tensors via export_hf_weights). Each resumed run builds a freshly
initialised model, loads the step-1 checkpoint and takes update 2 on the same data: loss, grad
norm, lr and weights must equal the uninterrupted ones. That needs the weights, the AdamW
moments and step count (resharded from TP=2 to TP=1 x DP=2 and to PP=2, with megatron's
distributed optimizer, sharded over DP, and without) and the lr schedule (update 2 is the end of
the warmup). A control that loads the weights only (fresh optimizer and schedule) must end
elsewhere, so the comparison can fail.

The DP=2 run then saves (the distributed optimizer gathers its DP shards), takes update 3, and
a TP=2 run resumed from that checkpoint must take the same update 3.

Also checked: the trainer state round-trips; the RNG state is restored when the layout is
unchanged; ``latest`` ignores a crashed save's ``.tmp`` directory; the next save removes it
and keeps only the newest ``checkpoint.keep_last`` (2) checkpoints.
"""

import random
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import assert_close, spawn
from tests.helpers.policy import hf_weights, make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SAMPLER = {"epoch": 0, "cursor": 8, "order_seed": 17}


def check_update(actor, xs2, want, what):
    m = actor.get_loss_and_metrics(xs2)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy"):
        assert_close(torch.tensor(m[key]), torch.tensor(want["metrics"][key]), f"{what}: {key}")
    got = hf_weights(actor)
    for name, tensor in want["weights"].items():
        assert_close(got[name], tensor, f"{what}: {name} after update 2", atol=1e-6, rtol=1e-5)


def _worker(rank, root, dist_opt):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.checkpoint import checkpoint_name, latest_checkpoint, load_checkpoint

    root = Path(root)
    hf = tiny_hf_config()
    step1 = root / checkpoint_name(1)

    # The uninterrupted run, TP=2.
    actor = MegatronActor(tiny_cfg(tp=2, dist_opt=dist_opt), hf)
    xs1 = with_actor_log_probs(actor, make_samples(0), seed=1)
    actor.get_loss_and_metrics(xs1)
    assert actor.save_checkpoint(str(root), {"step": 1, "sampler": SAMPLER}) == str(step1)
    weights1 = hf_weights(actor)
    xs2 = with_actor_log_probs(actor, make_samples(1), seed=2)
    want = dict(metrics=actor.get_loss_and_metrics(xs2), weights=hf_weights(actor))
    assert want["metrics"]["actor/lr"] == pytest.approx(tiny_cfg().optim.lr)  # end of the warmup
    actor.save_checkpoint(str(root), {"step": 2})
    # The RNG state comes back at an unchanged layout (here: into the same, already-trained actor).
    draws = (torch.rand(3), random.random())
    torch.rand(5), random.random()
    assert actor.load_checkpoint(str(root)) == {"step": 2}
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    # A save that crashed half-way leaves a .tmp directory: `latest` is unaffected.
    if rank == 0:
        (root / (checkpoint_name(3) + ".tmp")).mkdir()
        (root / (checkpoint_name(3) + ".tmp") / "common.pt").write_bytes(b"partial")
    torch.distributed.barrier()
    assert latest_checkpoint(root) == root / checkpoint_name(2)
    destroy_parallel(process_group=False)

    for what, parallel in (("TP=2 -> PP=2", dict(pp=2)), ("TP=2 -> TP=1 x DP=2", dict(tp=1))):
        resumed = MegatronActor(tiny_cfg(dist_opt=dist_opt, **parallel), hf)
        before = hf_weights(resumed)
        assert max((before[n] - weights1[n]).abs().max() for n in weights1) > 1e-2  # a fresh model
        assert resumed.load_checkpoint(str(step1)) == {"step": 1, "sampler": SAMPLER}
        loaded = hf_weights(resumed)
        for name, tensor in weights1.items():
            assert torch.equal(loaded[name], tensor), f"{what}: {name} as saved"
        if parallel == dict(tp=1):  # control: the weights alone (fresh AdamW and lr schedule)
            control = MegatronActor(tiny_cfg(dist_opt=dist_opt, **parallel), hf, initialize=False)
            load_checkpoint(step1, model=control.model)
            control.get_loss_and_metrics(xs2)
            moved = hf_weights(control)
            gap = max((moved[n] - want["weights"][n]).abs().max() for n in moved)
            assert gap > 1e-3, f"without the optimizer state update 2 should differ (max diff {gap})"
        check_update(resumed, xs2, want, what)
        if parallel == dict(tp=1):
            # A save at DP=2 (the distributed optimizer gathers its shards); keep_last = 2 leaves
            # steps 2 and 3, and the crashed save is gone. Then update 3, the new reference.
            resumed.save_checkpoint(str(root), {"step": 3})
            names = sorted(p.name for p in root.iterdir())
            assert names == ["latest", checkpoint_name(2), checkpoint_name(3)], names
            assert latest_checkpoint(root) == root / checkpoint_name(3)
            lp3 = resumed.get_inference_log_probs(make_samples(2))  # DP=2: each rank half, all-gathered
            xs3 = with_actor_log_probs(resumed, make_samples(2), seed=3, log_probs=lp3)
            want3 = dict(metrics=resumed.get_loss_and_metrics(xs3), weights=hf_weights(resumed))
        destroy_parallel(process_group=False)

    # The DP=2 checkpoint back at TP=2, from the root's latest: update 3 as in the DP=2 run.
    again = MegatronActor(tiny_cfg(tp=2, dist_opt=dist_opt), hf)
    assert again.load_checkpoint(str(root)) == {"step": 3}
    for i, (got, want_lp) in enumerate(zip(again.get_inference_log_probs(make_samples(2)), lp3)):
        assert_close(got, want_lp, f"log-probs of sample {i}: TP=2 vs TP=1 x DP=2")
    check_update(again, xs3, want3, "TP=1 x DP=2 -> TP=2")
    destroy_parallel(process_group=False)


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed_optimizer", "optimizer"])
def test_checkpoint_reshards_and_resumes(tmp_path, dist_opt):
    spawn(_worker, str(tmp_path), dist_opt)
