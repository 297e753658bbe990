"""From prompts to scored prompt groups: generation, reward, overlong shaping, advantages.

The training step's data path (docs/DESIGN.md "One step") minus the model update, engine-agnostic and
free of megatron: a generation batch, split over the rollout replicas, becomes ``Group`` objects
(one prompt, G rollouts, correctness, shaped rewards) that dynamic sampling filters, and a kept set
of groups becomes the trainer's ``Sample`` list with GRPO advantages.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import torch

from megatron_dapo.algo import get_advantage_fn, overlong_filter_mask, overlong_penalty
from megatron_dapo.batching import Sample
from megatron_dapo.config import DAPOConfig, RewardConfig, RolloutConfig
from megatron_dapo.config_algo import AlgorithmConfig
from megatron_dapo.observe.audit import GroupAudit, audit_group
from megatron_dapo.observe.rows import RowSpec, SampleRow, group_rows, pick_flagged
from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.placements import Placement

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
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**plain, "rollouts": [r.to_json() for r in self.rollouts]}

    @classmethod
    def from_json(cls, data: dict) -> "Group":
        return cls(**{**data, "rollouts": [Rollout.from_json(r) for r in data["rollouts"]]})


def score_rollouts(outputs: list[list[Rollout]], truths: list[str], *, tokenizer, pool,
                   fns: tuple[str | None, ...] = (None,), texts_out: list | None = None) -> list[list[dict]]:
    """Decodes every response of ``outputs`` (per prompt, same order as ``truths``) once and scores
    it with each reward fn named in ``fns`` (None: the pool's default, reward.fn): per fn, one
    reward dict per response, flat in prompt-major order. ``texts_out``: receives the decoded texts."""
    flat = [r for group in outputs for r in group]
    texts = tokenizer.batch_decode([r.response_ids for r in flat], skip_special_tokens=True)
    gts = [gt for gt, group in zip(truths, outputs) for _ in group]
    scored: dict = {}
    for fn in fns:
        if fn not in scored:
            scored[fn] = pool.score(texts, gts, fn=fn)
    if texts_out is not None:
        texts_out.extend(texts)
    return [scored[fn] for fn in fns]


def shape_groups(indices: list[int], outputs: list[list[Rollout]], results: list[dict], reward: RewardConfig,
                 rollout: RolloutConfig) -> list[Group]:
    """Scored rollouts of the prompts ``indices`` -> Groups with overlong-shaped rewards."""
    n = rollout.n
    scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    rewards = scores.clone()
    ob = reward.overlong_buffer
    if ob.enable:
        lengths = torch.tensor([len(r.response_ids) for group in outputs for r in group])
        rewards += overlong_penalty(lengths, max_response_len=rollout.max_response_length,
                                    buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    groups = []
    for g, (index, rollouts) in enumerate(zip(indices, outputs)):
        sl = slice(g * n, (g + 1) * n)
        groups.append(Group(prompt_index=index, rollouts=rollouts, acc=[r["acc"] for r in results[sl]],
                            scores=scores[sl].tolist(), rewards=rewards[sl].tolist()))
    return groups


def generate_scored(placement: Placement, prompt_ids: list[list[int]], n: int, params: SamplingParams, *,
                    ground_truths: list[str], tokenizer, pool, fns: tuple[str | None, ...] = (None,),
                    summarise: Callable[[int, list[Rollout], list[list[dict]], list[str]], T],
                    fetch: Callable[[], tuple[range, list[list[Rollout]]]] | None = None) -> list[T]:
    """Generate -> score -> gather, the one protocol of training and evaluation.

    Every replica generates its share of ``prompt_ids`` (``n`` responses each; ``ground_truths``
    aligned with them); its leader scores the share with each reward fn of ``fns`` and summarises
    each prompt: ``summarise(position in prompt_ids, its n rollouts, per fn its n reward dicts, the n
    decoded responses)``. Only the summaries travel; returns one per prompt, in prompt order, on
    every rank. ``fetch``: where the rollouts come from instead (a batch asked for ahead,
    rollout/pipeline.py), in ``placement.generate``'s form.
    """
    share, outputs = fetch() if fetch is not None else placement.generate(prompt_ids, n, params)
    local: list[T] = []
    if placement.is_leader and share:
        texts: list[str] = []
        scored = score_rollouts(outputs, [ground_truths[p] for p in share], tokenizer=tokenizer, pool=pool, fns=fns,
                                texts_out=texts)
        for j, (p, rollouts) in enumerate(zip(share, outputs)):
            sl = slice(j * n, (j + 1) * n)
            local.append(summarise(p, rollouts, [results[sl] for results in scored], texts[sl]))
    return placement.gather(local)


@dataclass
class GenBatch:
    """One generation batch's outcome, on every rank, in batch order."""

    groups: list[Group | None]  # None where dynamic sampling dropped the group (unless carry_all)
    acc: torch.Tensor  # [P, G] bool correctness
    audits: list[GroupAudit]  # format and scorer-agreement counts of every group (observe/audit.py)
    rows: list[SampleRow]  # dump rows of the groups at positions < RowSpec.dump_groups
    flagged: list[SampleRow]  # flagged responses (alarm dumps), a bounded number per replica


def generate_groups(placement: Placement, prompt_ids: list[list[int]], indices: list[int], *,
                    ground_truths: list[str], tokenizer, params: SamplingParams, pool, cfg: DAPOConfig,
                    keep: Callable[[torch.Tensor], torch.Tensor], rows: RowSpec | None = None,
                    fetch: Callable[[], tuple[range, list[list[Rollout]]]] | None = None,
                    carry_all: bool = False) -> GenBatch:
    """One generation batch (the prompts ``indices``), split over the rollout replicas.

    Each replica's leader scores (with reward.fn and, when ``rows.audit_scorer``, the audit scorer)
    and shapes its share, applies ``keep`` (dynamic sampling's filter: [P, G] acc -> [P] bool) and
    audits every group; only kept groups, counts, and the bounded dump rows travel (every group with
    ``carry_all``: dynamic sampling may fill an exhausted step from them). ``fetch``: as
    generate_scored's.
    """
    fns = (None, rows.audit_scorer) if rows is not None and rows.audit_scorer else (None,)
    flag_counts: dict[str, int] = {}  # this leader's share: flagged rows sent so far, per flag

    def summarise(p: int, rollouts: list[Rollout], scored: list[list[dict]], texts: list[str]):
        group, = shape_groups([indices[p]], [rollouts], scored[0], cfg.reward, cfg.rollout)
        kept = bool(keep(torch.tensor([group.acc], dtype=torch.bool))[0])
        audit_results = scored[1] if len(scored) > 1 else None
        audit, flags = audit_group(texts, group.acc, [r["acc"] for r in audit_results] if audit_results else None)
        dumped, flagged = [], []
        if rows is not None and (p < rows.dump_groups or any(flags)):
            prompt = tokenizer.batch_decode([rollouts[0].prompt_ids], skip_special_tokens=True)[0] if rollouts else ""
            made = group_rows(rows, prompt_index=indices[p], position=p, prompt=prompt, texts=texts, rollouts=rollouts,
                              ground_truth=ground_truths[indices[p]], results=scored[0], audit_results=audit_results,
                              flags=flags, scores=group.scores, rewards=group.rewards, kept=kept)
            dumped = made if p < rows.dump_groups else []
            flagged = pick_flagged(made, flag_counts, rows.flag_cap)
        return group.acc, group if kept or carry_all else None, audit, dumped, flagged

    gathered = generate_scored(placement, [prompt_ids[i] for i in indices], cfg.rollout.n, params,
                               ground_truths=[ground_truths[i] for i in indices], tokenizer=tokenizer, pool=pool,
                               fns=fns, summarise=summarise, fetch=fetch)
    acc = torch.tensor([g[0] for g in gathered], dtype=torch.bool).reshape(len(gathered), cfg.rollout.n)
    return GenBatch(groups=[g[1] for g in gathered], acc=acc,
                    audits=[g[2] for g in gathered], rows=[r for g in gathered for r in g[3]],
                    flagged=[r for g in gathered for r in g[4]])


def to_samples(groups: list[Group], algorithm: AlgorithmConfig, reward: RewardConfig):
    """Kept groups -> trainer samples with GRPO advantages (per response) and loss masks, and the
    engine's log-probs where it returned them (for rollout correction, algorithm.rollout_correction, and
    train.old_log_probs=rollout). One tensor per kind for the whole batch, split into per-sample
    views: a tensor per sample and kind was a visible cost of the CPU demo's step."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [P, G]
    advantages = get_advantage_fn(algorithm.estimator)(rewards, eps=algorithm.adv_eps)
    rollouts = [r for g in groups for r in g.rollouts]
    resp_n = [len(r.response_ids) for r in rollouts]
    prompts = torch.tensor([t for r in rollouts for t in r.prompt_ids], dtype=torch.long).split(
        [len(r.prompt_ids) for r in rollouts])
    responses = torch.tensor([t for r in rollouts for t in r.response_ids], dtype=torch.long).split(resp_n)
    keep = torch.ones(len(rollouts))
    if reward.overlong_filter:
        keep = overlong_filter_mask(torch.tensor([r.finish_reason == "length" for r in rollouts])).float()
    masks = keep.repeat_interleave(torch.tensor(resp_n, dtype=torch.long)).split(resp_n)
    with_lp = [bool(r.logprobs) for r in rollouts]
    engine = iter(torch.tensor([lp for r in rollouts for lp in r.logprobs], dtype=torch.float32).split(
        [n for n, has in zip(resp_n, with_lp) if has]))
    routes = [routes_of(r) for r in rollouts]
    return [Sample(prompt_ids=p, response_ids=resp, advantages=adv, loss_mask=mask,
                   rollout_log_probs=next(engine) if has else None, routed_experts=route)
            for p, resp, adv, mask, has, route in zip(prompts, responses, advantages.reshape(-1).tolist(), masks,
                                                      with_lp, routes)]


def routes_of(rollout: Rollout) -> torch.Tensor | None:
    """The engine's routes of a rollout as [tokens fed, layers x k] int16 (Rollout.routed_experts), None without."""
    return None if rollout.routed_experts is None else rollout.routed_experts.tensor()


def version_lag(groups: list[Group], version: int) -> dict[str, float]:
    """How many weight versions the kept batch's rollouts lag behind the trainer's ``version``
    (steps trained so far): 0 for a synchronous step's own batches, up to rollout.max_staleness for
    batches asked for ahead (rollout/pipeline.py), more for groups carried over (surplus=carry) and for
    partial rollouts (the version of a response's first piece, rollout/partial.py)."""
    lags = torch.tensor([version - r.weight_version for g in groups for r in g.rollouts], dtype=torch.float32)
    return {"rollout/version_lag_mean": lags.mean().item(), "rollout/version_lag_max": lags.max().item()}


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
