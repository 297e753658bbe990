"""The MoE metrics across processes, against transformers: a tiny Qwen3-MoE (tests/helpers/moe.py; 4 experts,
top-2) updates on one batch at TP=1 x DP=2 and at TP=2 with sequence parallelism (2 gloo processes), from
the same HF weights, with the load-balancing loss and a z-loss on.

Reference: transformers' own router logits for each micro-batch the trainer ran (DP=2: each rank's share,
``split_for_data_parallel``, one micro-batch each; TP=2: the batch in two micro-batches of 3), the
Switch load-balancing loss and the z-loss of every (micro-batch, layer) written out here over the real
tokens, and their mean: what moe/load_balancing_loss and moe/z_loss report (mcore/moe.py
``router_losses``: each TP rank's share summed for the first, averaged for the second; DP summed).

Under sequence parallelism megatron computes the z-loss per TP rank as a mean over that rank's slice of
the sequence (router.py ``apply_z_loss``: coefficient / TP): with right-padded rows the first half of a
row holds more real tokens than the second, and the slices' mean of means is not the batch's mean. With
rows of one length (no padding) the two agree; with ragged rows the reported z-loss (and the update) is
megatron's, checked to differ from the batch mean. The load-balancing loss divides by the batch's
tokens on every rank (global counts over TP) and equals the reference at both layouts.

Rollout routing replay's agreement (moe/route_agreement, random expert pairs replayed) is the same at
both layouts: counts of (token, layer) pairs summed over TP and DP.

The global load-balancing loss (moe.load_balancing=global_aux_loss) at DP=2 with unequal shares, one
rank running micro-batches of padding only, against megatron's definition written out (its own test
below). It failed before the metric counted the schedule's slots: the DP ranks' real micro-batches
(4 there, against 3 slots) under-reported it by 3/4, and by 1/DP whenever the ranks' counts are equal.
"""

import json

import pytest
import torch

from tests.distributed.harness import spawn
from tests.helpers.moe import TINY_MOE, moe_samples, save_tiny_moe, tiny_moe_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
BATCHES = {"ragged": [(3, 9), (5, 14), (2, 6), (7, 12), (4, 11), (6, 3)],  # (prompt, response)
           "even": [(4, 8)] * 6}  # 12 tokens each: no padding, each sequence-parallel slice half the tokens
LAYOUTS = ("tp1_dp2", "tp2_sp")
E, K, LAYERS = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"], TINY_MOE["num_hidden_layers"]


def _cfg(layout: str, replay: bool):
    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, MoEConfig, OptimConfig, OverlongBufferConfig, ParallelConfig,
        RewardConfig, RolloutConfig, TrainConfig,
    )

    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True) if layout == "tp2_sp" \
        else ParallelConfig()
    return DAPOConfig(
        seed=1, model=ModelConfig(make_vocab_size_divisible_by=64), parallel=parallel,
        moe=MoEConfig(load_balancing="aux_loss", z_loss_coeff=1e-3, router_replay="R3" if replay else "disabled"),
        data=DataConfig(prompts_per_step=2, gen_prompts_per_batch=2, max_prompt_length=8),
        rollout=RolloutConfig(engine="hf", temperature=0.8, max_response_length=16, n=3),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=4)),
        # micro-batches of 3 samples, whatever the padding multiple (a token budget would group otherwise
        # once sequence parallelism pads to even lengths; the router losses are per-micro-batch statistics)
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=0, micro_batch_size=3),
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=0))


def _worker(rank, hf_dir, out_dir):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    hf = json.loads((hf_dir / "config.json").read_text())
    got = {}
    for layout in LAYOUTS:
        for batch, replay in (("ragged", False), ("even", False), ("ragged", True)):
            shapes = BATCHES[batch]
            actor = MegatronActor(_cfg(layout, replay), hf)
            assert actor.load_hf_weights(str(hf_dir)) > 0
            m = actor.get_loss_and_metrics(moe_samples(shapes, routes=replay))
            keys = ("moe/route_agreement",) if replay else ("moe/load_balancing_loss", "moe/z_loss")
            got[f"{layout} {batch} {'r3' if replay else 'losses'}"] = {k: m[k] for k in keys}
            destroy_parallel(process_group=False)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(got))


@torch.no_grad()
def _reference(model, micro_batches) -> tuple[float, float]:
    """(load-balancing loss, z-loss) of transformers' router logits: each per (micro-batch, layer) over its
    real tokens, then the mean over micro-batches and layers."""
    lb, z = [], []
    for samples in micro_batches:
        width = max(x.num_tokens for x in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        real = torch.zeros(len(samples), width, dtype=torch.bool)
        for i, x in enumerate(samples):
            ids[i, :x.num_tokens] = torch.cat([x.prompt_ids, x.response_ids])
            real[i, :x.num_tokens] = True
        for logits in model(input_ids=ids, output_router_logits=True).router_logits:  # [b x width, E] per layer
            logits = logits[real.reshape(-1)].float()
            probs = torch.softmax(logits, -1)
            routed = torch.zeros(E).scatter_add_(0, probs.topk(K, -1).indices.reshape(-1), torch.ones(K * len(probs)))
            tokens = len(probs)
            lb.append(E * (probs.sum(0) * routed).sum() / (K * tokens * tokens))  # Switch: E sum_i f_i P_i
            z.append((torch.logsumexp(logits, -1) ** 2).mean())
    return torch.stack(lb).mean().item(), torch.stack(z).mean().item()


def test_router_metrics_over_tp_and_dp_equal_transformers(tmp_path):
    from megatron_dapo.batching import split_for_data_parallel

    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    spawn(_worker, hf_dir, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank reports the same
    got, model = ranks[0], tiny_moe_model(seed=3)
    for batch, shapes in BATCHES.items():
        xs = moe_samples(shapes)
        shards = [[xs[i] for i in shard] for shard in split_for_data_parallel(xs, 2)]  # one micro-batch each
        for layout, micro_batches in (("tp1_dp2", shards), ("tp2_sp", [xs[:3], xs[3:]])):
            lb, z = _reference(model, micro_batches)
            losses = got[f"{layout} {batch} losses"]
            assert losses["moe/load_balancing_loss"] == pytest.approx(lb, rel=1e-5), (layout, batch)
            if layout == "tp2_sp" and batch == "ragged":  # megatron's mean of each slice's mean (docstring)
                assert abs(losses["moe/z_loss"] - z) > 1e-3 * z, (layout, batch)
            else:
                assert losses["moe/z_loss"] == pytest.approx(z, rel=1e-5), (layout, batch)
    agreement = [got[f"{layout} ragged r3"]["moe/route_agreement"] for layout in LAYOUTS]
    assert 0.05 < agreement[0] < 0.95 and agreement[1] == pytest.approx(agreement[0], rel=1e-6)


GLOBAL_SHARDS = ([0], [1, 2, 3])  # rank 0: one sample, then micro-batches of padding only; rank 1: three


def _global_worker(rank, hf_dir, out_dir):
    import dataclasses

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import train_step

    cfg = _cfg("tp1_dp2", replay=False)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balancing="global_aux_loss", z_loss_coeff=0.0),
                              train=dataclasses.replace(cfg.train, micro_batch_size=1))
    actor = MegatronActor(cfg, json.loads((hf_dir / "config.json").read_text()))
    assert actor.load_hf_weights(str(hf_dir)) > 0
    xs = moe_samples(BATCHES["ragged"])
    m = train_step(actor.model, actor.optimizer, actor.scheduler, [xs[i] for i in GLOBAL_SHARDS[rank]],
                   actor.settings)
    (out_dir / f"global{rank}.json").write_text(json.dumps(m))
    destroy_parallel(process_group=False)


@torch.no_grad()
def _global_reference(model, slots) -> float:
    """megatron's global load-balancing loss (router.py ``_apply_global_aux_loss``), written out: in slot s
    of the schedule, every DP rank's micro-batch (None: padding only) adds its tokens to the counts per
    expert summed over DP, whose running mean over the slots so far weighs the probabilities of the
    slot's tokens over all ranks; the mean over slots and layers."""
    per_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    for s, micro_batches in enumerate(slots):
        for layer in range(LAYERS):
            per_layer.setdefault(layer, []).append((torch.zeros(E), torch.zeros(E), 0))
        for x in (mb for mb in micro_batches if mb is not None):
            ids = torch.cat([x.prompt_ids, x.response_ids])[None]
            for layer, logits in enumerate(model(input_ids=ids, output_router_logits=True).router_logits):
                probs = torch.softmax(logits.float(), -1)
                top = probs.topk(K, -1).indices.reshape(-1)
                routed = torch.zeros(E).scatter_add_(0, top, torch.ones(len(top)))
                p, c, t = per_layer[layer][s]
                per_layer[layer][s] = (p + probs.sum(0), c + routed, t + len(probs))
    losses = []
    for layer, per_slot in per_layer.items():
        counts = torch.zeros(E)
        for s, (probs, routed, tokens) in enumerate(per_slot):
            counts += routed
            losses.append(E * (probs * counts / (s + 1)).sum() / (K * tokens * tokens))
    return torch.stack(losses).mean().item()


def test_the_global_load_balancing_loss_over_dp_with_micro_batches_of_padding_only(tmp_path):
    """moe.load_balancing=global_aux_loss at DP=2, the ranks' shares unequal (one micro-batch against three):
    rank 0 runs two micro-batches of padding only, which join the loss's all-reduce and add no token. The
    update is finite and moe/load_balancing_loss equals megatron's definition written out on
    transformers' router logits: each slot's loss is shared over the DP ranks (summed), averaged over
    the slots of the schedule."""
    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    spawn(_global_worker, hf_dir, tmp_path)
    got = [json.loads((tmp_path / f"global{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and got[0]["actor/num_micro_batches"] == 3
    assert torch.isfinite(torch.tensor(got[0]["actor/grad_norm"]))
    xs = moe_samples(BATCHES["ragged"])
    slots = [[xs[0] if s == 0 else None, xs[1 + s]] for s in range(3)]
    want = _global_reference(tiny_moe_model(seed=3), slots)
    assert got[0]["moe/load_balancing_loss"] == pytest.approx(want, rel=1e-5)
