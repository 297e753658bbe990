"""From prompts to scored prompt groups: generation, reward, overlong shaping, advantages.

The training step's data path (DESIGN.md "One step") minus the model update, engine-agnostic and
free of megatron: a generation batch becomes ``Group`` objects (one prompt, G rollouts, correctness,
shaped rewards) that dynamic sampling filters, and a kept set of groups becomes the trainer's
``Sample`` list with GRPO advantages.
"""

from dataclasses import dataclass

import torch

from megatron_dapo.algo import get_advantage_fn, overlong_filter_mask, overlong_penalty
from megatron_dapo.config import DAPOConfig
from megatron_dapo.rollout.engine import Rollout, RolloutEngine, SamplingParams


@dataclass
class Group:
    """One prompt and its G scored rollouts."""

    prompt_index: int
    rollouts: list[Rollout]
    acc: list[bool]
    scores: list[float]  # +-1 correctness
    rewards: list[float]  # score + overlong penalty: what the advantages see


def generate_and_score(engine: RolloutEngine, prompt_ids: list[list[int]], truths: list[str], *, tokenizer,
                       params: SamplingParams, n: int, pool) -> tuple[list[list[Rollout]], list[Rollout], list[dict]]:
    """``n`` responses per prompt, decoded and scored: (per-prompt rollouts, flat rollouts, flat scores)."""
    outputs = engine.generate(prompt_ids, n, params)
    flat = [r for group in outputs for r in group]
    texts = tokenizer.batch_decode([r.response_ids for r in flat], skip_special_tokens=True)
    return outputs, flat, pool.score(texts, [gt for gt in truths for _ in range(n)])


def generate_groups(engine: RolloutEngine, prompt_ids: list[list[int]], indices: list[int], *,
                    ground_truths: list[str], tokenizer, params: SamplingParams, n: int, pool,
                    cfg: DAPOConfig) -> list[Group]:
    """Generates ``n`` responses for each prompt index, scores and shapes them."""
    outputs, flat, results = generate_and_score(engine, [prompt_ids[i] for i in indices],
                                                [ground_truths[i] for i in indices], tokenizer=tokenizer,
                                                params=params, n=n, pool=pool)
    scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    rewards = scores.clone()
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        lengths = torch.tensor([len(r.response_ids) for r in flat])
        rewards += overlong_penalty(lengths, max_response_len=cfg.rollout.max_response_length,
                                    buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    groups = []
    for g, (index, rollouts) in enumerate(zip(indices, outputs)):
        sl = slice(g * n, (g + 1) * n)
        groups.append(Group(prompt_index=index, rollouts=rollouts, acc=[r["acc"] for r in results[sl]],
                            scores=scores[sl].tolist(), rewards=rewards[sl].tolist()))
    return groups


def to_samples(groups: list[Group], cfg: DAPOConfig):
    """Kept groups -> trainer samples with GRPO advantages (per response) and loss masks."""
    from megatron_dapo.policy.batching import Sample

    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [P, G]
    advantages = get_advantage_fn(cfg.algorithm.adv_estimator)(rewards, eps=cfg.algorithm.adv_eps)
    samples = []
    for g, adv_row in zip(groups, advantages):
        for r, adv in zip(g.rollouts, adv_row.tolist()):
            keep = 1.0
            if cfg.reward.overlong_filter:
                keep = float(overlong_filter_mask(torch.tensor([r.finish_reason == "length"]))[0])
            response = torch.tensor(r.response_ids, dtype=torch.long)
            samples.append(Sample(prompt_ids=torch.tensor(r.prompt_ids, dtype=torch.long), response_ids=response,
                                  advantages=adv, loss_mask=torch.full((len(response),), keep)))
    return samples


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
    """The paper's monitoring set for the kept batch: accuracy, rewards, lengths, truncation."""
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
    acc = torch.tensor([a for g in groups for a in g.acc], dtype=torch.float32)
    scores = torch.tensor([x for g in groups for x in g.scores])
    rewards = torch.tensor([x for g in groups for x in g.rewards])
    return {
        "reward/acc_mean": acc.mean().item(),
        "reward/score_mean": scores.mean().item(),
        "reward/overlong_penalty_mean": (rewards - scores).mean().item(),
        "reward/shaped_mean": rewards.mean().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
    }
