"""Context parallelism: CP = 2, alone and with TP 2 + SP, PP 2 and DP 2, makes the update one process
makes in plain torch.

Reference (each rank, redundantly): tests/helpers/reference.py's plain-torch update, a TP=1 GPTModel
on the whole batch right-padded by hand, one loss over the whole batch, torch's clip_grad_norm_ and
AdamW. Each CP layout loads the same weights and gives the log-probs (forward only) and one update
through ``MegatronActor``; the loss, grad norm, entropy, clip fractions, the token count and the
updated weights must equal the reference's, for the default token-mean DAPO loss and for GSPO (a
sequence ratio: every position of a response, on whichever CP rank, enters one exp(mean)).

The distributed optimizer shards Adam's state over DP x CP (megatron's intra_dp_cp group), as the
plan (memory_plan.py) counts it.

What fails here when CP is wrong: a token counted on each CP rank (counts gathered over DP x CP, or
the loss not divided by CP) doubles the count or the gradient; a chunk gathered in the wrong order
scrambles the log-probs of every sample; attention that sees only a rank's own positions, or keys
past a query, changes them too.
"""

import dataclasses

import pytest
import torch

from tests.distributed.harness import assert_close, full_params, spawn
from tests.distributed.test_policy_train_step import assert_hf_equal, load_weights, to_hf
from tests.helpers.policy import LR, make_samples, tiny_cfg, tiny_hf_config
from tests.helpers.reference import reference_forward, reference_update, with_old_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GSPO = dict(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None,
            loss_agg_mode="seq-mean-token-mean")


def _gspo_loss(fw):
    from megatron_dapo.algo import compute_gspo_loss

    kw = {k: v for k, v in GSPO.items() if k != "policy_loss"}
    return compute_gspo_loss(fw["lp"], fw["old"], fw["adv"], fw["mask"], **kw)[0]


def _references(hf, xs_seed: int):
    """(samples, the reference forward, {loss name: (HF weights after its update, its figures)}, w0)."""
    from megatron_dapo.mcore import build_model, destroy_parallel, initialize_parallel

    base = tiny_cfg()
    initialize_parallel(hf, parallel=base.parallel, model=base.model, seed=3)
    ref = build_model(hf, model=base.model, parallel=base.parallel)[0]
    w0 = full_params([ref])
    xs = with_old_log_probs(ref, make_samples(xs_seed), seed=1)
    with torch.no_grad():
        fw0 = reference_forward(ref, xs)
    wants = {}
    for name, loss_fn in (("dapo", None), ("gspo", _gspo_loss)):
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(w0[n])
        want = reference_update(ref, xs, lr=LR / 2, loss_fn=loss_fn)
        wants[name] = (to_hf(full_params([ref]), hf), want)
    destroy_parallel(process_group=False)
    return xs, fw0, wants, w0


def _check_layout(name: str, kw: dict, hf, xs, fw0, wants, w0):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    for k, (loss, packed) in enumerate((("dapo", False), ("gspo", False), ("dapo", True), ("gspo", True))):
        actor = MegatronActor(tiny_cfg(**kw), hf, initialize=k == 0)
        assert ps.get_context_parallel_world_size() == kw["cp"]
        actor.settings = dataclasses.replace(actor.settings, pack_sequences=packed, **(GSPO if loss == "gspo" else {}))
        load_weights(actor, w0)
        what = f"{name}, {loss}{', packed' if packed else ''}"
        if loss == "dapo":
            lps = actor.get_inference_log_probs(xs)
            for i, s in enumerate(fw0["spans"]):
                assert_close(lps[i], fw0["lp"][i, s], f"{what}: log-probs of sample {i}")
        hf_w1, want = wants[loss]
        m = actor.get_loss_and_metrics(xs)
        assert m["actor/num_tokens"] == want["num_tokens"], (what, m["actor/num_tokens"], want["num_tokens"])
        assert_close(torch.tensor(m["actor/pg_loss"]), want["loss"], f"{what}: loss")
        assert_close(torch.tensor(m["actor/grad_norm"]), want["grad_norm"], f"{what}: grad norm")
        assert_close(torch.tensor(m["actor/entropy"]), want["entropy"], f"{what}: entropy")
        if loss == "dapo":  # token-mean: the output layer's gradients from the loss's hint held on every rank
            assert m["actor/grad_shortcut_used"] > 0 and m["actor/grad_shortcut_fallbacks"] == 0, (what, m)
            for key in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low", "actor/ratio_mean", "actor/ratio_max"):
                assert_close(torch.tensor(m[key]), want["metrics"][key], f"{what}: {key}")
        assert_hf_equal(actor, hf_w1, f"{what}: weights after the update")
        if loss == "dapo":  # the distributed optimizer shards Adam's state over DP x CP (the plan counts it so)
            shards = ps.get_data_parallel_world_size(with_context_parallel=True)
            assert shards == 2 * ps.get_data_parallel_world_size()
            held = sum(p.numel() for c in actor.model for p in c.parameters())
            assert abs(_adam_numel(actor.optimizer) - held / shards) <= 64 * shards, (what, held, shards)
    destroy_parallel(process_group=False)


def _adam_numel(optimizer) -> int:
    """Elements of Adam's first moment this rank keeps (after an update)."""
    return sum(state["exp_avg"].numel() for opt in getattr(optimizer, "chained_optimizers", [optimizer])
               for state in opt.optimizer.state.values())


def _worker(rank, layouts):
    hf = tiny_hf_config(num_hidden_layers=4)
    xs, fw0, wants, w0 = _references(hf, xs_seed=0)
    for name, kw in layouts:
        _check_layout(name, kw, hf, xs, fw0, wants, w0)


def test_cp2_equals_one_process():
    spawn(_worker, [("cp2", dict(cp=2))])


def test_cp2_composes_with_tp_pp_dp():
    spawn(_worker, [("cp2_tp2_sp", dict(cp=2, tp=2, sp=True)), ("cp2_pp2", dict(cp=2, pp=2)),
                    ("cp2_dp2", dict(cp=2))], world_size=4)
