"""The train step (mcore/train_step.py) at TP=2 + SP, PP=2 and PP=2 x VPP=2 equals one process (TP=1)
doing the update by hand in plain torch.

Reference (each rank, redundantly): the plain-torch update of tests/helpers/reference.py, a TP=1
GPTModel on the whole batch right-padded by hand, full-vocabulary log-probs, one token-mean loss,
torch's clip_grad_norm_ and AdamW with megatron's no-decay rule. Then each layout loads the same
weights (sharded by hand, harness.py) and runs ``compute_log_probs`` (forward only) and
``train_step``; the updated weights come back as full HF tensors through
``MegatronActor.export_hf_weights`` and must equal the reference's.

Adam's first step is lr * g / (|g| + eps): with the default eps it is ~ lr * sign(g) and would
hide a wrong gradient scale, so these tests use adam_eps = 1e-2 (tests/helpers/policy.tiny_cfg),
above most |g| of this tiny model (after clipping): the update is then close to lr * g / eps.
clip_grad is set below the gradient norm so that the global norm (over TP / PP / DP) matters.
The TP=2 layout also runs the mini-batch as 1 micro-batch and as 4 (token budget), and each layout
padded and packed (samples end to end, batching.py; the default, auto, packs under VPP alone): 4 packs
of the same budget, uniform [1, 56] under VPP.
"""

import dataclasses

import pytest
import torch

from tests.distributed.harness import assert_close, full_params, load_full, spawn
from tests.helpers.policy import CLIP, LR, make_samples, tiny_cfg, tiny_hf_config, unwrap
from tests.helpers.reference import reference_forward, reference_update, with_old_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def to_hf(weights: dict, hf: dict, padded_vocab: int = 128) -> dict:
    from megatron_dapo.convert import conversion_table, megatron_to_hf_state_dict
    return megatron_to_hf_state_dict(conversion_table(hf, padded_vocab_size=padded_vocab), weights)


def load_weights(actor, weights: dict) -> None:
    from megatron.core import parallel_state as ps
    load_full([unwrap(c) for c in actor.model], weights, ps.get_tensor_model_parallel_rank(),
              ps.get_tensor_model_parallel_world_size())


def assert_hf_equal(actor, want: dict, what: str, atol=1e-6):
    got = dict(actor.export_hf_weights())
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(got[name], want[name], f"{what}: {name}", atol=atol, rtol=1e-5)


def _worker(rank):
    from megatron_dapo.mcore import build_model, destroy_parallel, initialize_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import compute_log_probs, train_step

    hf = tiny_hf_config(num_hidden_layers=4)
    base = tiny_cfg()
    initialize_parallel(hf, parallel=base.parallel, model=base.model, seed=3)
    ref = build_model(hf, model=base.model, parallel=base.parallel)[0]
    w0 = full_params([ref])
    xs = with_old_log_probs(ref, make_samples(0), seed=1)
    with torch.no_grad():
        fw0 = reference_forward(ref, xs)
    want = reference_update(ref, xs, lr=LR / 2)
    assert want["grad_norm"] > 2 * CLIP  # clipping is active
    w1 = full_params([ref])
    assert max((w1[k] - w0[k]).abs().max() for k in w0) > 1e-3  # the update is far above the tolerances
    hf_w1 = to_hf(w1, hf)
    destroy_parallel(process_group=False)

    layouts = [("tp2_sp", dict(tp=2, sp=True)), ("pp2", dict(pp=2)),
               # interleaved at PP=2: uniform [2, 28] micro-batches (optimizer.py), 4 of them at 56 tokens
               ("pp2_vpp2", dict(pp=2, vpp=2, dist_opt=False, budget=56))]
    for name, kw in layouts:
        actor = MegatronActor(tiny_cfg(**kw), hf)
        # train.pack_sequences=auto packs where micro-batches must share one shape: interleaved PP 2 alone here
        assert actor.settings.pack_sequences is (name == "pp2_vpp2"), name
        padded = dataclasses.replace(actor.settings, pack_sequences=False)
        packed = dataclasses.replace(actor.settings, pack_sequences=True)
        load_weights(actor, w0)
        lps, ents = compute_log_probs(actor.model, xs, padded)
        for i, s in enumerate(fw0["spans"]):
            assert_close(lps[i], fw0["lp"][i, s], f"{name}: log-probs of sample {i}")
            assert_close(ents[i], fw0["ent"][i, s], f"{name}: entropy of sample {i}")
        lps, ents = compute_log_probs(actor.model, xs, packed)
        for i, s in enumerate(fw0["spans"]):
            assert_close(lps[i], fw0["lp"][i, s], f"{name}, packed: log-probs of sample {i}")
        variants = [("4 micro-batches", padded, actor)]
        others = [("4 packed micro-batches", packed)]  # each from the same start on an actor of its own
        if name == "tp2_sp":
            others.append(("1 micro-batch", dataclasses.replace(padded, max_tokens_per_micro_batch=0,
                                                                micro_batch_size=len(xs))))
        for what, settings in others:
            fresh = MegatronActor(tiny_cfg(**kw), hf, initialize=False)
            load_weights(fresh, w0)
            variants.append((what, settings, fresh))
        for what, settings, a in variants:
            m = train_step(a.model, a.optimizer, a.scheduler, xs, settings)
            assert m["actor/num_micro_batches"] == (1 if what.startswith("1") else 4), m
            assert_close(torch.tensor(m["actor/pg_loss"]), want["loss"], f"{name}, {what}: loss")
            assert_close(torch.tensor(m["actor/grad_norm"]), want["grad_norm"], f"{name}, {what}: grad norm")
            assert_close(torch.tensor(m["actor/entropy"]), want["entropy"], f"{name}, {what}: entropy")
            for key in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low", "actor/ratio_mean",
                        "actor/ratio_max"):
                assert_close(torch.tensor(m[key]), want["metrics"][key], f"{name}, {what}: {key}")
            assert m["actor/num_tokens"] == want["num_tokens"] and m["actor/lr"] == pytest.approx(LR / 2)
            assert_hf_equal(a, hf_w1, f"{name}, {what}: weights after the update")
        destroy_parallel(process_group=False)


def test_train_step_layouts_equal_one_process():
    spawn(_worker)
