"""DAPO in NeMo-Aligner's trainer: a DAPO actor on its Megatron GPT PPO actor, and a critic-free
trainer hook, for nemo-aligner 0.7.0; docs/nemo_aligner.md has the recipe, the sources (file:line)
and what was verified. Importing it imports no NeMo; tests/nemo_aligner/ runs it in the real stack.

Two halves: here the pure parts, tested without NeMo (rollout batch -> our loss inputs, the loss in
the actor's ``loss_func`` shape, group advantages for the critic's GAE, dynamic sampling, overlong
shaping, settings from NeMo-style sections); in nemo_aligner_classes.py ``dapo_actor_class()`` /
``dapo_trainer_class()``, which import NeMo-Aligner on first call and subclass
``MegatronGPTActorModel`` and ``ReinforceTrainer``, taking megatron names from the upstream
module's own namespace, and the upstream functions they rely on.

NeMo-Aligner's batch convention (ppo.py, reinforce.py, ppo_utils.py at v0.7.0), B rows, S tokens:
``response_tokens`` [B, S] prompt + response, padded with eos; ``prompt_lengths`` / ``response_lengths``
[B] (the response occupies columns prompt_length .. response_length - 1, its eos included);
``is_end`` [B] bool, ended with an end string; ``rewards`` [B] from the reward server. Log-probs are
shifted: ``logprobs`` [B, S - 1], column j = log p(token j + 1 | tokens <= j); ``mask`` [B, S - 1] is 1
on columns prompt_length - 1 .. response_length - 2, i.e. exactly the response tokens. Our loss
takes any [B, T] with a mask, so the shifted tensors go in unchanged.

Where the actor differs from the PPO actor it extends, and why:

* Loss: PPO's symmetric ``ratio_eps`` clip becomes Clip-Higher (``clip_ratio_low`` / ``_high``, optional
  dual clip ``clip_ratio_c``); no entropy bonus; no KL (``get_init_policy_logprobs`` refuses).
* Normalisation: the PPO actor takes ``masked_mean`` per micro-batch (each micro-batch's own token
  count), then megatron's schedule averages micro-batches and the optimizer averages DP ranks, so a
  token's weight depends on how the batch was split (with micro_batch_size 1: a per-sequence mean).
  Here every micro-batch divides its token-loss sum by the valid-token count of the whole
  mini-batch on all DP ranks, all-reduced before the schedule runs, and multiplies by M x DP to undo
  the schedule's 1 / M and the gradient average's 1 / DP: the gradient is then exactly that of the
  global token-mean (docs/DESIGN.md "Numerics contract"), given megatron-core's 1 / M for a 2-tuple
  loss_func and an optimizer that averages gradients over DP (docs/nemo_aligner.md says what is read
  and what is assumed).
* ``is_end``: PPO zeroes non-ended responses; DAPO keeps truncated responses (the overlong penalty
  handles them) unless ``overlong_filter`` is set, in which case the trainer hook folds ``is_end``
  into ``mask``. The loss reads ``mask`` only.
* Metrics: sums over micro-batches and DP ranks of terms already divided by the global count (the
  mini-batch mean), ``*_max`` by max; upstream averages per-micro-batch means.

The trainer hook extends ``ReinforceTrainer``: reward server only (no critic), G rollouts per prompt,
and its rollout batch holds the whole global batch on every rank, so groups are complete there.
It overrides ``generate_rollouts`` only: generation batches are drawn until ``prompts_per_step``
mixed groups are held (``algo.DynamicSampler``), then advantages, and each DP rank keeps its share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.algo import get_advantage_fn, get_policy_loss_fn, overlong_penalty
from megatron_dapo.config import AlgorithmConfig, LossConfig, OverlongBufferConfig, RewardConfig
from megatron_dapo.config_loading import build

NEMO_ALIGNER_VERSION = "0.7.0"
INSTALL_HINT = (f"install nemo-aligner=={NEMO_ALIGNER_VERSION} with its stack (NeMo 2.1, Megatron-LM "
                "core_r0.10.0, apex, Transformer Engine, lightning): the NeMo-Aligner v0.7.0 container has "
                "all of it; see docs/nemo_aligner.md")


# The rollout-batch keys the trainer hook reads from ReinforceTrainer._run_inference's result: the
# actor's infer() (ppo actor 352-357), prompt_tokens (reinforce 275), logprobs (303), rewards (317).
ROLLOUT_KEYS = ("response_tokens", "response_lengths", "prompt_lengths", "is_end", "logprobs", "rewards")
# What the loss reads; the PPO actor's last pipeline stage receives these plus is_end (ppo actor 117).
LOSS_BATCH_KEYS = ("response_tokens", "advantages", "mask", "prev_logprobs")
# algo.compute_policy_loss's metrics (without TIS, which NeMo's batch cannot feed: no engine log-probs).
LOSS_METRIC_KEYS = ("actor/pg_loss", "actor/pg_clipfrac_high", "actor/pg_clipfrac_low",
                    "actor/pg_clipfrac_dual", "actor/ratio_mean", "actor/ratio_max", "actor/ppo_kl")


# -- settings: NeMo-style config sections, validated by our own schema -------------------------------

def _plain(node: Any) -> Any:
    """A DictConfig / ListConfig / Mapping tree -> plain dicts and lists."""
    if isinstance(node, Mapping) or hasattr(node, "items"):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)) or (hasattr(node, "__iter__") and not isinstance(node, (str, bytes))):
        return [_plain(v) for v in node]
    return node


def loss_settings(ppo_cfg: Any) -> LossConfig:
    """``model.ppo.loss`` (our ``loss:`` section's keys and defaults) -> LossConfig.

    ``model.ppo.entropy_bonus`` must be 0: DAPO has no entropy term and this loss does not add one."""
    ppo = _plain(ppo_cfg)
    # "auto" keys take the policy loss's paper values; seq-mean-token-sum-norm needs loss_scale_factor
    loss = build(LossConfig, ppo.get("loss") or {}, where="model.ppo.loss.").resolved(None)
    if ppo["entropy_bonus"]:  # a required key of the PPO actor (its __init__ reads it)
        raise ValueError(f"model.ppo.entropy_bonus={ppo['entropy_bonus']}: the DAPO loss has no entropy "
                         "bonus; set 0.0")
    return loss


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The DAPO part of the trainer section (``trainer.dapo``); see nemo_aligner_dapo.yaml."""
    prompts_per_step: int
    """Mixed prompt groups per training step (dynamic sampling draws generation batches until held)."""
    group_size: int
    """Responses per prompt G: the section's num_rollouts_per_prompt (ReinforceTrainer's key)."""
    max_response_length: int
    """L_max of the overlong penalty: model.ppo.length_params.max_length, the generation limit."""
    algorithm: AlgorithmConfig
    """Advantage estimator and dynamic sampling (our ``algorithm:`` section)."""
    overlong_buffer: OverlongBufferConfig
    """Soft overlong punishment (our ``reward.overlong_buffer``)."""
    overlong_filter: bool
    """Fold is_end into the loss mask: truncated responses carry no loss (our ``reward.overlong_filter``)."""


def trainer_settings(dapo_cfg: Any, *, max_response_length: int, model_gbs: int) -> TrainerSettings:
    """Reads ``trainer.dapo`` (``model_gbs``: model.global_batch_size, in responses) and checks that the
    upstream keys fit DAPO: no KL to the initial policy, batch sizes that divide."""
    cfg = _plain(dapo_cfg)
    kl = cfg["initial_policy_kl_penalty"]  # a required key of ReinforceTrainer
    if kl != 0:
        raise ValueError(f"trainer.dapo.initial_policy_kl_penalty={kl}: DAPO has no KL term; set it to 0 "
                         "(then no reference policy is kept or run)")
    reward_raw = cfg.get("reward") or {}
    extra = sorted(set(reward_raw) - {"overlong_buffer", "overlong_filter"})
    if extra:
        raise ValueError(f"trainer.dapo.reward: unknown keys {extra}; the reward comes from the reward "
                         "server, so only overlong_buffer and overlong_filter apply")
    reward = build(RewardConfig, reward_raw, where="trainer.dapo.reward.")
    algorithm = build(AlgorithmConfig, cfg.get("algorithm") or {}, where="trainer.dapo.algorithm.")
    if algorithm.filter_groups.surplus != "drop":
        raise ValueError("trainer.dapo.algorithm.filter_groups.surplus must be 'drop': NeMo-Aligner's "
                         "checkpoint does not hold groups carried between steps")
    if algorithm.rollout_correction.active:
        raise ValueError("trainer.dapo.algorithm.rollout_correction must stay off: NeMo-Aligner's rollout batch "
                         "carries the trainer's own log-probs (get_inference_log_probs), not the rollout engine's, "
                         "so there is nothing to correct")
    settings = TrainerSettings(prompts_per_step=int(cfg["prompts_per_step"]),
                               group_size=int(cfg["num_rollouts_per_prompt"]),
                               max_response_length=int(max_response_length), algorithm=algorithm,
                               overlong_buffer=reward.overlong_buffer, overlong_filter=reward.overlong_filter)
    rows = settings.prompts_per_step * settings.group_size
    if settings.group_size < 2 or rows % model_gbs:
        raise ValueError(f"need num_rollouts_per_prompt >= 2 and prompts_per_step x num_rollouts_per_prompt "
                         f"= {rows} divisible by model.global_batch_size = {model_gbs} (responses per "
                         "optimizer step)")
    if reward.overlong_buffer.enable and not 0 < reward.overlong_buffer.len <= max_response_length:
        raise ValueError(f"trainer.dapo.reward.overlong_buffer.len={reward.overlong_buffer.len} must be in "
                         f"(0, model.ppo.length_params.max_length={max_response_length}]")
    return settings


# -- the rollout batch: masks, groups, advantages, dynamic sampling ----------------------------------

def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B], [B] -> [B, width] float: 1 on shifted columns prompt_length - 1 .. response_length - 2,
    the response tokens (NeMo-Aligner's create_mask convention, vectorised)."""
    col = torch.arange(width, device=prompt_lengths.device)
    start, end = (prompt_lengths - 1).unsqueeze(-1), (response_lengths - 1).unsqueeze(-1)
    return ((col >= start) & (col < end)).to(torch.float32)


def group_rows(response_tokens: torch.Tensor, prompt_lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B, S], [B] -> [P, G] row indices of each prompt group.

    Rows with the same prompt (the first prompt_length tokens) form a group, in order of first
    appearance. A prompt drawn k times in one batch has k * G rows; its responses are exchangeable,
    so they are cut into k groups in row order. Any other count means a rollout went missing."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (row, n) in enumerate(zip(response_tokens.tolist(), prompt_lengths.tolist())):
        by_prompt.setdefault(tuple(row[:n]), []).append(i)
    groups = []
    for rows in by_prompt.values():
        if len(rows) % group_size:
            raise ValueError(f"prompt of row {rows[0]} has {len(rows)} responses, not a multiple of the "
                             f"group size {group_size} (num_rollouts_per_prompt)")
        groups += [rows[k:k + group_size] for k in range(0, len(rows), group_size)]
    return torch.tensor(groups, dtype=torch.long).reshape(-1, group_size)


def select_rows(batch: Mapping[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows.to(v.device)] for k, v in batch.items()}


def concat_rollout_batches(batches: Sequence[Mapping[str, torch.Tensor]],
                           eos_id: int) -> dict[str, torch.Tensor]:
    """Row-concatenates batches whose 2-D tensors may differ in width (each generation batch is
    padded to its own longest row): response_tokens pads with eos, everything else with 0, as
    NeMo-Aligner's from_rollout_batches does."""
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() == 2:
            width = max(p.shape[1] for p in parts)
            pad = eos_id if key == "response_tokens" else 0
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts]
        out[key] = torch.cat(parts)
    return out


def correctness(rewards: torch.Tensor) -> torch.Tensor:
    """The reward server returns the +1 / -1 correctness score (our reward.compute_score's ``score``);
    a response is correct when it is positive. Dynamic sampling reads this, not the shaped reward."""
    return rewards.reshape(-1) > 0


def dapo_rollout_data(batch: Mapping[str, torch.Tensor], groups: torch.Tensor,
                      settings: TrainerSettings) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A rollout batch (``ROLLOUT_KEYS``, B rows) and its [P, G] groups -> what the actor trains on.

    Returns ({response_tokens [B, S], prev_logprobs [B, S-1], mask [B, S-1], advantages [B, S-1],
    is_end [B]}, metrics). The advantage of a response is the group z-score of its shaped reward
    (+-1 score + overlong penalty), broadcast over its tokens: it replaces the critic's GAE."""
    if sorted(groups.reshape(-1).tolist()) != list(range(batch["rewards"].shape[0])):
        raise ValueError(f"groups must cover every row once: {tuple(groups.shape)} for "
                         f"{batch['rewards'].shape[0]} rows")
    logprobs = batch["logprobs"]
    mask = response_mask(batch["prompt_lengths"], batch["response_lengths"], logprobs.shape[1])
    mask = mask.to(logprobs.device)
    score = batch["rewards"].reshape(-1).to(torch.float32)
    num_generated = batch["response_lengths"] - batch["prompt_lengths"]
    shaped = score
    ob = settings.overlong_buffer
    if ob.enable:
        penalty = overlong_penalty(num_generated, max_response_len=settings.max_response_length,
                                   buffer_len=ob.len, penalty_factor=ob.penalty_factor)
        shaped = score + penalty.to(score.device)
    is_end = batch["is_end"].reshape(-1).bool()
    if settings.overlong_filter:
        mask = mask * is_end.to(mask.dtype).unsqueeze(-1)
    groups = groups.to(score.device)
    estimator = get_advantage_fn(settings.algorithm.estimator)
    per_row = torch.empty_like(shaped)
    per_row[groups] = estimator(shaped[groups], eps=settings.algorithm.adv_eps)
    data = {"response_tokens": batch["response_tokens"], "prev_logprobs": logprobs, "mask": mask,
            "advantages": per_row.to(logprobs.dtype).unsqueeze(-1) * mask, "is_end": batch["is_end"]}
    metrics = {"dapo/score_mean": score.mean().item(), "dapo/shaped_reward_mean": shaped.mean().item(),
               "dapo/acc_mean": correctness(score).float().mean().item(),
               "dapo/response_length_mean": num_generated.float().mean().item(),
               "dapo/frac_not_ended": (~is_end).float().mean().item()}
    return data, metrics


def data_parallel_share(data: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Contiguous 1 / size of the rows for DP rank ``rank`` (the row count must divide)."""
    rows = next(iter(data.values())).shape[0]
    if rows % size:
        raise ValueError(f"{rows} rows do not split over {size} data-parallel ranks")
    n = rows // size
    return {k: v[rank * n:(rank + 1) * n] for k, v in data.items()}


# -- the loss, in the actor's loss_func shape -------------------------------------------------------

@dataclass(frozen=True)
class LossCounts:
    """Denominators of one mini-batch, the same on every rank and micro-batch."""
    num_tokens: torch.Tensor | float   # valid tokens of the mini-batch over all DP ranks
    num_seqs: torch.Tensor | float     # sequences with >= 1 valid token, likewise (seq-mean modes)
    schedule_scale: float              # M x DP: undoes the schedule's 1 / M and the gradient's 1 / DP


def local_loss_counts(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask of this rank's mini-batch share -> [2] float (valid tokens, valid sequences), to be
    summed over DP."""
    return torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(torch.float32)


def dapo_micro_batch_loss(curr_log_probs: torch.Tensor, batch: Mapping[str, torch.Tensor], loss: LossConfig,
                          counts: LossCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch: curr_log_probs [b, S-1] (from from_parallel_logits_to_logprobs) and the batch's
    prev_logprobs / advantages / mask [b, S-1] -> (the loss handed to megatron's schedule, metrics).

    The loss is the micro-batch's term of the global aggregate (``algo.compute_policy_loss`` with the
    global denominators) times ``counts.schedule_scale``; metrics are unscaled, detached, and sum
    (``*_max``: max) to the mini-batch value over micro-batches and DP ranks."""
    fn = get_policy_loss_fn(loss.policy_loss)
    value, metrics = fn(curr_log_probs, batch["prev_logprobs"], batch["advantages"], batch["mask"],
                        **loss.loss_kwargs(), global_num_tokens=counts.num_tokens, global_num_seqs=counts.num_seqs)
    return value * counts.schedule_scale, metrics


def reduce_micro_batch_metrics(per_micro_batch: Sequence[Mapping[str, torch.Tensor]],
                               device: torch.device | str = "cpu") -> torch.Tensor:
    """Metrics of this rank's micro-batches -> [len(LOSS_METRIC_KEYS)]: sums, max for ``*_max``; zeros
    when there are none (pipeline stages before the last) and for a key the loss does not report (gspo
    and cispo have no dual clip)."""
    out = torch.zeros(len(LOSS_METRIC_KEYS), dtype=torch.float32, device=device)
    for i, key in enumerate(LOSS_METRIC_KEYS):
        values = [m[key].float().to(device) for m in per_micro_batch if key in m]
        if values:
            out[i] = torch.stack(values).max() if key.endswith("_max") else torch.stack(values).sum()
    return out


def batch_keys_for_stage(pp_size: int, first: bool, last: bool) -> set[str] | None:
    """Keys a pipeline stage moves to the GPU (None: all of them), as the PPO actor does, minus is_end."""
    if pp_size == 1:
        return None
    keys = {"attention_mask"}
    if first:
        keys |= {"response_tokens", "position_ids"}
    if last:
        keys |= set(LOSS_BATCH_KEYS)
    return keys
