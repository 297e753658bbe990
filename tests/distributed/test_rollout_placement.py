"""HF engine replicas in 2 gloo processes: whatever the replica layout, the gathered rollouts,
scored groups and evaluation equal those of one engine generating the whole batch.

Layouts: rollout TP=1 (2 replicas, each generating its share) and rollout TP=2 (one replica over
both ranks). The reference on each rank is the same engine placed ``alone`` (the one-process path).
The reward is replaced by a deterministic stand-in (a response is "correct" when the sum of its
token ids is even) so that groups are mixed and dynamic sampling really drops some: the placement is under test,
the reward has its own tests.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.distributed.harness import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 8], [7, 9], [100, 101, 102, 103, 104], [3], [60, 61, 62]]  # 5: uneven split


class ParityPool:
    """Stand-in RewardPool: the default fn scores even token sums correct, fn="odd" odd ones."""

    def score(self, texts, truths, fn=None):
        want = 1 if fn == "odd" else 0
        ok = [sum(map(int, t.split())) % 2 == want for t in texts]
        return [{"score": 1.0 if e else -1.0, "acc": e, "pred": t} for e, t in zip(ok, texts)]


class CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, seq)) for seq in ids]


def _engine():
    from megatron_dapo.rollout.hf_engine import HFEngine

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # peaked distributions: EOS is drawn now and then, lengths vary
        model.model.embed_tokens.weight.normal_(0, 0.5)
    return HFEngine(model, eos_token_ids=(1,))


def _same_rollouts(got, want):
    """Token for token; log-probs to fp32 round-off (another batch composition sums in another order)."""
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_ids, g.response_ids, g.finish_reason) == (w.prompt_ids, w.response_ids, w.finish_reason)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)


def _check(rank, rollout_tp):
    from megatron_dapo.algo import DynamicSampler
    from megatron_dapo.groups import generate_groups
    from megatron_dapo.observe.rows import RowSpec
    from megatron_dapo.config import DAPOConfig, OverlongBufferConfig, RewardConfig, RolloutConfig
    from megatron_dapo.eval import evaluate
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout.placement import RolloutPlacement

    engine = _engine()
    placement = RolloutPlacement(engine, tensor_parallel_size=rollout_tp)
    alone = RolloutPlacement(engine, alone=True)
    assert placement.num_replicas == 2 // rollout_tp and alone.num_replicas == 1
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=11)

    # Raw rollouts: this replica's share, gathered, equals the whole batch from one engine.
    share, mine = placement.generate(PROMPTS, 3, params)
    gathered = placement.gather(mine)
    reference = engine.generate(PROMPTS, 3, params)
    assert len(share) == (len(PROMPTS) if rollout_tp == 2 else [3, 2][rank])
    for got, want in zip(gathered, reference, strict=True):
        _same_rollouts(got, want)
    lengths = {len(r.response_ids) for group in reference for r in group}
    assert len(lengths) > 1, "the test needs responses of different lengths"

    # Scored groups with dynamic sampling's filter: same groups, same drops, same order.
    cfg = DAPOConfig(rollout=RolloutConfig(engine="hf", n=3, max_response_length=8),
                     reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=4)))
    dyn = DynamicSampler(prompts_per_step=2, group_size=3, max_num_gen_batches=0)
    indices = [4, 0, 3, 1, 2]  # the sampler's order: generation position != prompt index
    kw = dict(ground_truths=["1"] * 5, tokenizer=CharTokenizer(), params=params, pool=ParityPool(), cfg=cfg,
              keep=dyn.keep_mask)
    # Dump rows of the first 2 positions and every flagged response: the same rows from the replicas.
    spec = RowSpec(phase="train", dump_groups=2, flag_cap=100, max_chars=200, scorer="parity", audit_scorer="odd")
    batch = generate_groups(placement, PROMPTS, indices, rows=spec, **kw)
    ref = generate_groups(alone, PROMPTS, indices, rows=spec, **kw)
    assert batch.rows == ref.rows and batch.flagged == ref.flagged and batch.audits == ref.audits
    assert [r.group for r in batch.rows] == [0] * 3 + [1] * 3 and len(batch.audits) == len(indices)
    groups, acc, ref_groups, ref_acc = batch.groups, batch.acc, ref.groups, ref.acc
    assert torch.equal(acc, ref_acc) and [g is None for g in groups] == [g is None for g in ref_groups]
    for got, want in zip(groups, ref_groups):
        if got is not None:
            assert (got.prompt_index, got.acc, got.scores, got.rewards) == \
                (want.prompt_index, want.acc, want.scores, want.rewards)
            _same_rollouts(got.rollouts, want.rollouts)
    assert [g is None for g in groups] == (~dyn.keep_mask(acc)).tolist()
    assert 0 < sum(g is None for g in groups) < len(groups), "the test needs kept and dropped groups"
    assert [g.prompt_index for g in groups if g is not None] == [i for i, g in zip(indices, groups) if g]

    # Evaluation split the same way gives the same numbers.
    evaluated = evaluate(placement, PROMPTS, ["1"] * 5, tokenizer=CharTokenizer(), params=params, n=3,
                         pool=ParityPool() if placement.is_leader else None)
    assert evaluated == evaluate(alone, PROMPTS, ["1"] * 5, tokenizer=CharTokenizer(), params=params, n=3,
                                 pool=ParityPool())
    # With a second scorer: its numbers under the "_value" suffix, split and gathered the same way.
    both = evaluate(placement, PROMPTS, ["1"] * 5, tokenizer=CharTokenizer(), params=params, n=3,
                    pool=ParityPool() if placement.is_leader else None, value_fn="odd")
    assert both == evaluate(alone, PROMPTS, ["1"] * 5, tokenizer=CharTokenizer(), params=params, n=3,
                            pool=ParityPool(), value_fn="odd")
    assert {k: v for k, v in both.items() if not k.endswith(("_value", "scorer_disagreement"))} == evaluated
    assert both["eval/scorer_disagreement"] == 1.0  # parity: exactly one of the two holds
    assert both["eval/avg@3"] + both["eval/avg@3_value"] == pytest.approx(1.0)


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_replicas_gather_what_one_engine_generates(rollout_tp):
    spawn(_check, rollout_tp)


class CountingEngine:
    """The HF engine, counting generate() calls: a replica that skips one would hang vLLM's
    data-parallel lockstep (every replica all-reduces "anything unfinished?" per engine step)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, n, params, *, prompt_indices=None):
        self.calls.append(len(prompt_ids))
        return self.engine.generate(prompt_ids, n, params, prompt_indices=prompt_indices)

    def wake_up(self):
        pass


def _shares(rank, world):
    import torch.distributed as dist

    from megatron_dapo.groups import generate_groups
    from megatron_dapo.config import DAPOConfig, OverlongBufferConfig, RewardConfig, RolloutConfig
    from megatron_dapo.eval import evaluate
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout.placement import RolloutPlacement

    engine = CountingEngine(_engine())
    placement = RolloutPlacement(engine, tensor_parallel_size=1)
    alone = RolloutPlacement(engine.engine, alone=True)
    assert placement.num_replicas == world
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=11)
    cfg = DAPOConfig(rollout=RolloutConfig(engine="hf", n=3, max_response_length=8),
                     reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=4)))
    kw = dict(tokenizer=CharTokenizer(), params=params, cfg=cfg,
              keep=lambda acc: torch.ones(len(acc), dtype=torch.bool))
    # A batch of one prompt, one fewer than the replicas, and one not divisible by them.
    sizes = sorted({1, world - 1, world + 1})
    for size in sizes:
        indices = list(range(size))[::-1]
        batch = generate_groups(placement, PROMPTS, indices, ground_truths=["1"] * 5,
                                pool=ParityPool() if placement.is_leader else None, **kw)
        ref = generate_groups(alone, PROMPTS, indices, ground_truths=["1"] * 5, pool=ParityPool(), **kw)
        groups, acc, ref_groups, ref_acc = batch.groups, batch.acc, ref.groups, ref.acc
        assert torch.equal(acc, ref_acc) and len(groups) == size
        for got, want in zip(groups, ref_groups, strict=True):
            assert (got.prompt_index, got.acc, got.rewards) == (want.prompt_index, want.acc, want.rewards)
            _same_rollouts(got.rollouts, want.rollouts)
    # Evaluation of one problem: every replica but the first has nothing to do, and still takes part.
    one = evaluate(placement, PROMPTS[:1], ["1"], tokenizer=CharTokenizer(), params=params, n=3,
                   pool=ParityPool() if placement.is_leader else None)
    assert one == evaluate(alone, PROMPTS[:1], ["1"], tokenizer=CharTokenizer(), params=params, n=3,
                           pool=ParityPool())
    want_calls = [len(placement.share(size)) for size in sizes] + [len(placement.share(1))]
    assert engine.calls == want_calls  # one call per generation on every rank, empty shares included
    everyone = [None] * world
    dist.all_gather_object(everyone, engine.calls)
    assert [len(c) for c in everyone] == [len(sizes) + 1] * world
    assert any(0 in c for c in everyone), "the test needs a replica with an empty share"


@pytest.mark.parametrize("world", [2, 4])
def test_every_replica_takes_part_whatever_its_share(world):
    spawn(_shares, world, world_size=world)
