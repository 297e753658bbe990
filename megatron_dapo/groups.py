"""From prompts to scored prompt groups: generation, reward, overlong shaping, advantages.

The training step's data path (docs/DESIGN.md "One step") minus the model update, engine-agnostic and
free of megatron: a generation batch, split over the rollout replicas, becomes ``Group`` objects
(one prompt, G rollouts, correctness, shaped rewards) that dynamic sampling filters, and a kept set
of groups becomes the trainer's ``Sample`` list with GRPO advantages.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from megatron_dapo.algo import get_advantage_fn, overlong_filter_mask, overlong_penalty
from megatron_dapo.batching import Sample
from megatron_dapo.config import DAPOConfig
from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.placement import RolloutPlacement

T = TypeVar("T")


@dataclass
class Group:
    """One prompt and its G scored rollouts."""

    prompt_index: int
    rollouts: list[Rollout]
    acc: list[bool]
    scores: list[float]  # +-1 correctness
    rewards: list[float]  # score + overlong penalty: what the advantages see

    def to_json(self) -> dict:
        """Plain JSON (a held group travels in the trainer state of a checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Group":
        return cls(**{**data, "rollouts": [Rollout(**r) for r in data["rollouts"]]})


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


def generate_scored(placement: RolloutPlacement, prompt_ids: list[list[int]], n: int, params: SamplingParams, *,
                    ground_truths: list[str], tokenizer, pool, fns: tuple[str | None, ...] = (None,),
                    summarise: Callable[[int, list[Rollout], list[list[dict]]], T]) -> list[T]:
    """Generate -> score -> gather, the one protocol of training and evaluation.

    Every replica generates its share of ``prompt_ids`` (``n`` responses each; ``ground_truths``
    aligned with them); its leader scores the share with each reward fn of ``fns`` and summarises
    each prompt: ``summarise(position in prompt_ids, its n rollouts, per fn its n reward dicts)``.
    Only the summaries travel; returns one per prompt, in prompt order, on every rank.
    """
    share, outputs = placement.generate(prompt_ids, n, params)
    local: list[T] = []
    if placement.is_leader and share:
        scored = score_rollouts(outputs, [ground_truths[p] for p in share], tokenizer=tokenizer, pool=pool, fns=fns)
        for j, (p, rollouts) in enumerate(zip(share, outputs)):
            local.append(summarise(p, rollouts, [results[j * n:(j + 1) * n] for results in scored]))
    return placement.gather(local)


def generate_groups(placement: RolloutPlacement, prompt_ids: list[list[int]], indices: list[int], *,
                    ground_truths: list[str], tokenizer, params: SamplingParams, pool, cfg: DAPOConfig,
                    keep: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[Group | None], torch.Tensor]:
    """One generation batch (the prompts ``indices``), split over the rollout replicas.

    Each replica's leader scores and shapes its share and applies ``keep`` (dynamic sampling's
    filter: [P, G] acc -> [P] bool); only kept groups travel. Returns, on every rank and in batch
    order, the groups (None where dropped) and the [P, G] bool correctness.
    """
    def summarise(p: int, rollouts: list[Rollout], scored: list[list[dict]]) -> tuple[list[bool], Group | None]:
        group, = shape_groups([indices[p]], [rollouts], scored[0], cfg)
        kept = bool(keep(torch.tensor([group.acc], dtype=torch.bool))[0])
        return group.acc, group if kept else None

    gathered = generate_scored(placement, [prompt_ids[i] for i in indices], cfg.rollout.n, params,
                               ground_truths=[ground_truths[i] for i in indices], tokenizer=tokenizer, pool=pool,
                               summarise=summarise)
    return [g for _, g in gathered], torch.tensor([acc for acc, _ in gathered], dtype=torch.bool)


def to_samples(groups: list[Group], cfg: DAPOConfig):
    """Kept groups -> trainer samples with GRPO advantages (per response) and loss masks."""
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
