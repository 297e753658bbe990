"""Rollout routing replay (R3) on a tiny Qwen3-MoE, against transformers' own router as the reference.

* The HF engine's routes (RouteRecorder) are the experts the model's gates choose for every token it
  was fed -- the prompt and each response token but the last -- through left padding, batching and the
  compaction of finished rows: checked against a plain forward of each sequence alone, read with a hook
  of the test's own.
* The trainer replays them: Megatron's log-probs with the engine's routes equal transformers' (its gates
  left alone), and with routes changed on a third of layer 0's tokens equal transformers' with its gates
  forced to the same experts (gate weights: the softmax over all experts, taken at the forced ones and
  renormalised, as Qwen3-MoE's router does at norm_topk_prob); moe/route_agreement counts the changed
  (token, layer) pairs as disagreeing and nothing else.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_dapo.batching import Sample
from megatron_dapo.config import (
    DAPOConfig, DataConfig, ModelConfig, MoEConfig, OptimConfig, OverlongBufferConfig, RewardConfig, RolloutConfig,
    TrainConfig,
)
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.hf_engine import HFEngine
from tests.helpers.moe import TINY_MOE, save_tiny_moe, tiny_moe_model

LAYERS, K, EXPERTS = TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]
SHAPES = [(3, 9), (5, 14), (2, 6), (7, 12), (4, 11), (6, 3)]  # (prompt, response)


def _gates(model):
    return [model.model.layers[i].mlp.gate for i in range(LAYERS)]


@torch.no_grad()
def _routes_alone(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, k] the experts each gate picks, the sequence fed alone (a hook of this test's own)."""
    seen = []
    hooks = [g.register_forward_hook(lambda m, i, o: seen.append(o[2].clone())) for g in _gates(model)]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


def test_engine_routes_are_the_gates_choice_for_every_fed_token():
    model = tiny_moe_model(seed=3)
    engine = HFEngine(model, eos_token_ids=[7, 11, 13, 17, 19, 23], max_batch_size=4, return_routed_experts=True)
    prompts = [[1, 2, 3], [4, 6, 8, 9, 10], [12, 14], [30, 31, 32, 33], [40], [50, 51, 52]]
    out = [r for group in engine.generate(prompts, 2, SamplingParams(max_tokens=10, seed=5)) for r in group]
    assert {r.finish_reason for r in out} == {"stop", "length"}  # rows leave the batch at different steps
    assert len({len(r.response_ids) for r in out}) > 2
    for r in out:
        fed = r.prompt_ids + r.response_ids[:-1]
        assert r.routed_experts.experts.dtype == np.uint8  # 4 experts: one byte each
        got = r.routed_experts.tensor().view(len(fed), LAYERS, K)
        want = _routes_alone(model, fed)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), (r.prompt_ids, r.response_ids)


def test_no_routes_unless_asked():
    engine = HFEngine(tiny_moe_model(), eos_token_ids=[7])
    (r,), = engine.generate([[1, 2, 3]], 1, SamplingParams(max_tokens=4, seed=1))
    assert r.routed_experts is None


def _forced(model, routes: torch.Tensor):
    """Patch every gate of ``model`` to route the next forward's tokens to ``routes`` [tokens, layers, k]
    (one sequence): weights as Qwen3-MoE's router computes them, at the forced experts."""
    def gate_forward(layer, gate, hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        idx = routes[:, layer].long()
        top = probs.gather(1, idx)
        top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    for layer, gate in enumerate(_gates(model)):
        gate.forward = lambda h, layer=layer, gate=gate: gate_forward(layer, gate, h)


@torch.no_grad()
def _hf_log_probs(model, sample: Sample, temperature: float) -> torch.Tensor:
    ids = torch.cat([sample.prompt_ids, sample.response_ids])
    logits = model(input_ids=ids[None]).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    return lp[sample.num_prompt_tokens - 1:]


def _changed(routes: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """``routes`` with a third of layer 0's tokens sent to another expert set; how many were changed."""
    out = routes.clone()
    rows = torch.nonzero(torch.rand(len(routes), generator=g) < 1 / 3)[:, 0]
    for t in rows.tolist():
        mine = set(routes[t, 0].tolist())
        out[t, 0] = torch.tensor(next(sorted(c) for c in _pairs() if set(c) != mine))
    return out, len(rows)


def _pairs():
    return [(a, b) for a in range(EXPERTS) for b in range(a + 1, EXPERTS)]


@pytest.fixture
def actor(tmp_path, world_of_one):
    from megatron_dapo.mcore.actor import MegatronActor

    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    cfg = DAPOConfig(seed=1, model=ModelConfig(make_vocab_size_divisible_by=64), moe=MoEConfig(router_replay="R3"),
                     data=DataConfig(prompts_per_step=2, gen_prompts_per_batch=2, max_prompt_length=8),
                     rollout=RolloutConfig(engine="hf", temperature=0.8, max_response_length=16, n=3),
                     reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=4)),
                     train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=40),
                     optim=OptimConfig(lr=1e-3, lr_warmup_steps=0))
    actor = MegatronActor(cfg, tiny_moe_model(seed=3).config.to_dict())
    assert actor.load_hf_weights(str(hf_dir)) > 0
    return actor


def _samples(model, changed: bool = False) -> tuple[list[Sample], int, int]:
    """Random sequences with the gates' own routes (or, ``changed``, a third of layer 0's changed); the
    number changed and of (token, layer) pairs with a route."""
    g = torch.Generator().manual_seed(8)
    samples, num_changed, pairs = [], 0, 0
    for p, r in SHAPES:
        ids = torch.randint(0, TINY_MOE["vocab_size"], (p + r,), generator=g)
        routes = _routes_alone(model, ids[:-1].tolist())
        if changed:
            routes, n = _changed(routes, g)
            num_changed += n
        pairs += routes.shape[0] * LAYERS
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], advantages=float(torch.randn((), generator=g)),
                              routed_experts=routes.reshape(len(routes), -1).to(torch.int16)))
    return samples, num_changed, pairs


def test_trainer_replays_the_engines_routes(actor):
    model = tiny_moe_model(seed=3)
    own, _, _ = _samples(model)
    for x, lp in zip(own, actor.get_inference_log_probs(own)):
        torch.testing.assert_close(lp, _hf_log_probs(model, x, 0.8), atol=1e-5, rtol=0)

    changed, num_changed, pairs = _samples(model, changed=True)
    assert num_changed > 5
    moved = 0.0
    for x, lp in zip(changed, actor.get_inference_log_probs(changed)):
        forced = tiny_moe_model(seed=3)
        last = torch.arange(K).expand(1, LAYERS, K)  # the last token's experts reach no log-prob
        _forced(forced, torch.cat([x.routed_experts.view(-1, LAYERS, K), last]))
        torch.testing.assert_close(lp, _hf_log_probs(forced, x, 0.8), atol=1e-5, rtol=0)
        moved = max(moved, (lp - _hf_log_probs(model, x, 0.8)).abs().max().item())
    assert moved > 1e-3  # the changed routes do change the log-probs: the replay is not a no-op

    # an update over them: the changed (token, layer) pairs, and only those, disagree with the router
    old = actor.get_inference_log_probs(changed)
    with_old = [dataclasses.replace(x, old_log_probs=lp) for x, lp in zip(changed, old)]
    metrics = actor.get_loss_and_metrics(with_old, forward_only=True)
    assert metrics["moe/route_agreement"] == pytest.approx(1 - num_changed / pairs, abs=1e-6)


def test_replay_without_routes_is_one_line(actor):
    bare = [Sample(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3, 4]))]
    with pytest.raises(ValueError, match="moe.router_replay=R3 but the micro-batch's samples carry no routed experts"):
        actor.get_inference_log_probs(bare)


def test_a_micro_batch_of_padding_replays_spread_experts_and_counts_nothing(actor):
    """A DP rank needing one more micro-batch than this one (its count in the table) makes this rank run a
    micro-batch of padding only, which has no routes: it replays experts spread over all of them (token t:
    t x k .., mod E) and adds nothing to the agreement. Before, it raised on that rank alone (its peers
    then waited in their collectives)."""
    from megatron_dapo.mcore.moe import routers
    from megatron_dapo.mcore.micro_batches import batch_counts
    from megatron_dapo.mcore.train_step import train_step

    model = tiny_moe_model(seed=3)
    own, _, _ = _samples(model)
    old = actor.get_inference_log_probs(own)
    xs = [dataclasses.replace(x, old_log_probs=lp) for x, lp in zip(own, old)]
    table = batch_counts(actor.model, [xs], actor.settings)[0]
    table[:, 2] += 1  # the busiest DP rank's count: one more than this rank needs
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, k, o: seen.append(m.router_replay.target_topk_idx.clone()),
                                     with_kwargs=True) for r in routers(actor.model[0])]
    try:
        metrics = train_step(actor.model, actor.optimizer, actor.scheduler, xs, actor.settings, forward_only=True,
                             counts_table=table)
    finally:
        for h in hooks:
            h.remove()
    assert metrics["actor/num_micro_batches"] == int(table[0, 2])
    assert metrics["moe/route_agreement"] == 1.0  # the samples' own routes; the padding counted nowhere
    last = seen[-1]  # the padding micro-batch's replay, last layer
    assert torch.equal(last, (torch.arange(len(last))[:, None] * K + torch.arange(K)) % EXPERTS)


def test_packed_micro_batches_replay_the_routes_of_each_sample(actor):
    """train.pack_sequences: the samples end to end, each sample's routes at its offset (batching.py) and
    -1 at its last token; the replayed log-probs equal transformers' with its gates forced, sample by
    sample, and the agreement counts the same pairs as the padded layout does."""
    model = tiny_moe_model(seed=3)
    changed, num_changed, pairs = _samples(model, changed=True)
    actor.settings = dataclasses.replace(actor.settings, pack_sequences=True)
    from megatron_dapo.mcore.micro_batches import log_prob_micro_batches

    mbs = log_prob_micro_batches(actor.model, changed, actor.settings)
    assert all(mb.packed for mb in mbs) and max(len(mb.sample_index) for mb in mbs) == 3  # several per row
    for x, lp in zip(changed, actor.get_inference_log_probs(changed)):
        forced = tiny_moe_model(seed=3)
        _forced(forced, torch.cat([x.routed_experts.view(-1, LAYERS, K), torch.arange(K).expand(1, LAYERS, K)]))
        torch.testing.assert_close(lp, _hf_log_probs(forced, x, 0.8), atol=1e-5, rtol=0)
    old = actor.get_inference_log_probs(changed)
    with_old = [dataclasses.replace(x, old_log_probs=lp) for x, lp in zip(changed, old)]
    metrics = actor.get_loss_and_metrics(with_old, forward_only=True)
    assert metrics["moe/route_agreement"] == pytest.approx(1 - num_changed / pairs, abs=1e-6)
