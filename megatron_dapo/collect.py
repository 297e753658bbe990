"""From prompts to scored prompt groups: generation, reward, overlong shaping, advantages.

The training step's data path (docs/DESIGN.md "One step") minus the model update, engine-agnostic and
free of megatron: a generation batch, split over the rollout replicas, becomes ``Group`` objects
(one prompt, G rollouts, correctness, shaped rewards) that dynamic sampling filters, and a kept set
of groups becomes the trainer's ``Sample`` list with GRPO advantages.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_dapo.algo import get_advantage_fn, overlong_filter_mask, overlong_penalty
from megatron_dapo.config import DAPOConfig
from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.placement import RolloutPlacement


@dataclass
class Group:
    """One prompt and its G scored rollouts."""

    prompt_index: int
    rollouts: list[Rollout]
    acc: list[bool]
    scores: list[float]  # +-1 correctness
    rewards: list[float]  # score + overlong penalty: what the advantages see


def score_rollouts(outputs: list[list[Rollout]], truths: list[str], *, tokenizer, pool,
                   fns: tuple[str | None, ...] = (None,)) -> list[list[dict]]:
    """Decodes every response of ``outputs`` (per prompt, same order as ``truths``) once and scores
    it with each reward fn named in ``fns`` (None: the pool's default, reward.fn): per fn, one
    reward dict per response, flat in prompt-major order."""
    flat = [r for group in outputs for r in group]
    texts = tokenizer.batch_decode([r.response_ids for r in flat], skip_special_tokens=True)
    gts = [gt for gt, group in zip(truths, outputs) for _ in group]
    scored: dict = {}
    for fn in fns:
        if fn not in scored:
            scored[fn] = pool.score(texts, gts, fn=fn)
    return [scored[fn] for fn in fns]


def shape_groups(indices: list[int], outputs: list[list[Rollout]], results: list[dict],
                 cfg: DAPOConfig) -> list[Group]:
    """Scored rollouts of the prompts ``indices`` -> Groups with overlong-shaped rewards."""
    n = cfg.rollout.n
    scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    rewards = scores.clone()
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        lengths = torch.tensor([len(r.response_ids) for group in outputs for r in group])
        rewards += overlong_penalty(lengths, max_response_len=cfg.rollout.max_response_length,
                                    buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    groups = []
    for g, (index, rollouts) in enumerate(zip(indices, outputs)):
        sl = slice(g * n, (g + 1) * n)
        groups.append(Group(prompt_index=index, rollouts=rollouts, acc=[r["acc"] for r in results[sl]],
                            scores=scores[sl].tolist(), rewards=rewards[sl].tolist()))
    return groups


def generate_groups(placement: RolloutPlacement, prompt_ids: list[list[int]], indices: list[int], *,
                    ground_truths: list[str], tokenizer, params: SamplingParams, pool, cfg: DAPOConfig,
                    keep: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[Group | None], torch.Tensor]:
    """One generation batch (the prompts ``indices``), split over the rollout replicas.

    Each replica generates its share; its leader scores and shapes it and applies ``keep`` (dynamic
    sampling's filter: [P, G] acc -> [P] bool); only kept groups travel in the gather. Returns, on
    every rank and in batch order, the groups (None where dropped) and the [P, G] bool correctness.
    """
    share, outputs = placement.generate([prompt_ids[i] for i in indices], cfg.rollout.n, params)
    local: list[tuple[list[bool], Group | None]] = []
    if placement.is_leader and share:
        mine = [indices[p] for p in share]
        results, = score_rollouts(outputs, [ground_truths[i] for i in mine], tokenizer=tokenizer, pool=pool)
        groups = shape_groups(mine, outputs, results, cfg)
        kept = keep(torch.tensor([g.acc for g in groups], dtype=torch.bool)).tolist()
        local = [(g.acc, g if k else None) for g, k in zip(groups, kept)]
    gathered = placement.gather(local)
    return [g for _, g in gathered], torch.tensor([acc for acc, _ in gathered], dtype=torch.bool)


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
            # The engine's log-probs, for truncated importance sampling (loss.tis_cap).
            engine_lp = torch.tensor(r.logprobs, dtype=torch.float32) if r.logprobs else None
            samples.append(Sample(prompt_ids=torch.tensor(r.prompt_ids, dtype=torch.long), response_ids=response,
                                  advantages=adv, loss_mask=torch.full((len(response),), keep),
                                  rollout_log_probs=engine_lp))
    return samples


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
    """The paper's monitoring set for the kept batch: accuracy, rewards, lengths, truncation, and
    rollout/token_prob_mean, the mean over response tokens of the engine's probability of the
    sampled token (exp of its log-prob; absent when the engine returned no log-probs). The
    fractions of all-wrong / all-correct groups over every generated group are DynamicSampler's."""
    rollouts = [r for g in groups for r in g.rollouts]
    logprobs = [lp for r in rollouts for lp in r.logprobs]
    extra = {"rollout/token_prob_mean": torch.tensor(logprobs, dtype=torch.float64).exp().mean().item()} \
        if logprobs else {}
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
        **extra,
    }
