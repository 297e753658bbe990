"""Policy losses: DAPO's Clip-Higher surrogate (with an optional dual clip), GSPO's sequence-level
ratio and CISPO's clipped, stop-gradient importance weight. No KL term, no critic.

Shapes: B = sequences in this micro-batch, T = response length (padded). Every tensor argument is
[B, T]; ``advantages`` may also be [B] (one value per sequence, broadcast over its tokens).

Every loss returns the aggregated scalar (algo/aggregation.py: the mini-batch's denominators are
passed in, so micro-batch losses sum to the mini-batch's) and detached 0-d metric tensors with the
same convention: mean-type metrics are divided by the loss's token denominator, so summing them over
micro-batches and DP ranks gives the mini-batch mean; keys ending in ``_max`` reduce with max.

Clipping is decided by comparing the ratio with its bounds, and a token counted as clipped takes
the constant bound's value, so its gradient is exactly zero. (The textbook max(-A r, -A clip(r))
gives a tie, and half the unclipped gradient, where the two products round to one float though r
lies past the bound.) Values under a zero of the loss mask never reach the loss or its gradient.

Rollout correction (algo/rollout_correction.py: truncated or IcePop importance weights at token or
sequence level, for responses sampled by a policy other than pi_old): ``is_weights`` [B, T], detached,
multiply each token's loss before aggregation. A weight w > 0 commutes with the clips, so this equals
the plain loss with advantages w * A.
"""

import torch

from megatron_dapo.algo.aggregation import AGG_MODES, aggregate, masked
from megatron_dapo.registry import Registry

# Clamp |log(pi / pi_old)| before exp() so that a large trainer/rollout mismatch cannot overflow
# to inf and poison the step with NaN. exp(20) ~ 4.9e8 is far outside any clip range, so the clamp
# never changes a value that the clip would let through.
MAX_LOG_RATIO = 20.0
# GSPO's sequence log-ratio is capped above at 10 (verl's value): exp(10) ~ 2.2e4 is far outside
# GSPO's clip range (1 +- 4e-4), and the same cap keeps our loss equal to verl's at any input.
GSPO_MAX_LOG_RATIO = 10.0

POLICY_LOSSES: Registry = Registry("policy loss")

__all__ = ["AGG_MODES", "GSPO_MAX_LOG_RATIO", "MAX_LOG_RATIO", "POLICY_LOSSES", "aggregate",
           "compute_cispo_loss", "compute_gspo_loss", "compute_policy_loss", "get_policy_loss_fn"]


def dual_clip_error(clip_ratio_c: float | None, clip_ratio_high: float) -> str | None:
    """The dual clip's one rule, the config's and the loss's: c must exceed 1 + clip_ratio_high, the
    clipped ratio's ceiling, or the cap -A * c would bind inside the clip range (None: no dual clip)."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0 + clip_ratio_high:
        return (f"clip_ratio_c={clip_ratio_c} must exceed 1 + clip_ratio_high = {1.0 + clip_ratio_high} "
                "(verl uses 10.0), or be None (null) to disable the dual clip")
    return None


def _check(log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_weights, *, dual_clip: bool) -> None:
    if not 0.0 <= clip_ratio_low <= 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"need 0 <= clip_ratio_low <= 1 and clip_ratio_high >= 0, got "
                         f"{clip_ratio_low}, {clip_ratio_high}")
    if clip_ratio_c is not None and not dual_clip:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual clip belongs to the per-token PPO ratio "
                         "(policy loss dapo); pass None")
    if (error := dual_clip_error(clip_ratio_c, clip_ratio_high)) is not None:
        raise ValueError(error)
    if is_weights is not None and is_weights.shape != log_probs.shape:
        raise ValueError(f"is_weights must have the shape of log_probs {tuple(log_probs.shape)}, "
                         f"got {tuple(is_weights.shape)}")


def _clipped_surrogate(ratio, advantages, low_bound, high_bound):
    """[B, T] -A * ratio, or the bound's constant -A * bound where the ratio is clipped, and the two
    clip masks ((A > 0 and ratio > high), (A < 0 and ratio < low)). Equal in value to
    max(-A r, -A clip(r, low, high)); a clipped token's gradient is exactly zero."""
    high = (advantages > 0) & (ratio > high_bound)
    low = (advantages < 0) & (ratio < low_bound)
    bound = torch.where(high, torch.full_like(ratio, high_bound), torch.full_like(ratio, low_bound))
    return torch.where(high | low, -advantages * bound, -advantages * ratio), high, low


def _setup(log_probs, old_log_probs, advantages, loss_mask):
    """(advantages [B, T] and zero under the mask, the mask in log_probs' dtype, the masked log-ratio)."""
    mask = loss_mask.to(log_probs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = masked(advantages.to(log_probs.dtype).expand_as(log_probs), mask)
    return advantages, mask, masked(log_probs - old_log_probs, mask)


def _reduce(per_token, mask, loss_agg_mode, is_weights, *, global_num_tokens=None, global_num_seqs=None,
            loss_scale_factor=None):
    """(the aggregated loss, metrics so far, the metrics' token mean) of a [B, T] per-token loss, each
    token's term first multiplied by its detached importance weight when given. Metrics take the
    loss's token denominator (module docstring)."""
    def tmean(x):
        return aggregate(x.to(mask.dtype), mask, "token-mean", global_num_tokens=global_num_tokens)

    if is_weights is not None:
        per_token = per_token * masked(is_weights.detach().to(per_token.dtype), mask)
    loss = aggregate(per_token, mask, loss_agg_mode, global_num_tokens=global_num_tokens,
                     global_num_seqs=global_num_seqs, loss_scale_factor=loss_scale_factor)
    return loss, {"actor/pg_loss": loss.detach().clone()}, tmean


@POLICY_LOSSES.register("dapo")
def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    **denominators: float | int | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss with decoupled clip ranges (Clip-Higher, DAPO Eq. 10).

    Args:
        log_probs: [B, T] log pi_theta of the response tokens (carries the gradient).
        old_log_probs: [B, T] log pi_old of the same tokens (no gradient).
        advantages: [B, T] or [B] advantages.
        loss_mask: [B, T] 1 for response tokens that count, 0 for padding (and for whole responses
            removed by overlong filtering).
        clip_ratio_low / clip_ratio_high: ratio is clipped to [1 - low, 1 + high] (0.2 / 0.28).
        clip_ratio_c: dual clip (Ye et al. 2020, arXiv 1912.09729): for negative advantages the
            per-token loss is capped at -A * c, so a token whose ratio exploded (> c) stops
            pushing. None disables it; it must be > 1.
        loss_agg_mode: a name of algo/aggregation.py's AGG_MODES ("token-mean" for DAPO).
        **denominators: ``global_num_tokens``, ``global_num_seqs``, ``loss_scale_factor``, for the
            aggregation (algo/aggregation.py); another name is a TypeError.
        global_num_tokens: denominator of "token-mean": valid tokens of the whole mini-batch
            across micro-batches and DP ranks. None uses this micro-batch's count.
        global_num_seqs: denominator of the seq-mean modes, likewise (sequences with >= 1 valid
            token). None uses this micro-batch's count.
        loss_scale_factor: the constant of "seq-mean-token-sum-norm" (the generation budget).
        is_weights: [B, T] rollout correction's importance weights (algo/rollout_correction.py),
            detached, multiplying each token's loss; None: 1 (the loss is then bit-identical).

    Returns:
        (loss, metrics): a 0-d loss and detached 0-d metric tensors: ``actor/pg_clipfrac_high``
        (A > 0 and ratio above 1 + high), ``actor/pg_clipfrac_low`` (A < 0 and ratio below
        1 - low), ``actor/pg_clipfrac_dual`` (A < 0 and the loss above -A c), ``actor/ratio_mean``,
        ``actor/ratio_max``, ``actor/ppo_kl`` (k3 estimate of KL(pi_old || pi_theta)) and
        ``actor/pg_loss``. Tokens counted in a clip fraction get exactly zero gradient.
    """
    _check(log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_weights, dual_clip=True)
    advantages, mask, log_ratio = _setup(log_probs, old_log_probs, advantages, loss_mask)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    per_token, high, low = _clipped_surrogate(ratio, advantages, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    dual = torch.zeros_like(high)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    loss, metrics, tmean = _reduce(per_token, mask, loss_agg_mode, is_weights, **denominators)
    with torch.no_grad():
        metrics.update({
            "actor/pg_clipfrac_high": tmean(high),
            "actor/pg_clipfrac_low": tmean(low),
            "actor/pg_clipfrac_dual": tmean(dual),
            "actor/ratio_mean": tmean(ratio),
            "actor/ratio_max": masked(ratio, mask).max(),
            "actor/ppo_kl": tmean(ratio - 1.0 - log_ratio),
        })
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def compute_gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
    **denominators: float | int | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), in its GSPO-token form (Eq. 13-14): every token
    of response i carries the sequence ratio s_i = (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|)
    = exp(mean_t log r_i,t) in value, with the gradient of its own token,
    s_i,t = sg[s_i] x pi_theta(y_i,t) / sg[pi_theta(y_i,t)]; the clip decides on s_i for the whole
    response. With one advantage per response and "seq-mean-token-mean" (the default here) this is
    the paper's sequence-level objective, Eq. 5-7. The paper's clip range is [1 - 3e-4, 1 + 4e-4].

    Arguments as ``compute_policy_loss`` (``clip_ratio_c`` must be None: no dual clip). Metrics:
    ``actor/pg_clipfrac_high`` / ``_low`` (tokens of responses clipped above / below),
    ``actor/ratio_mean`` / ``_max`` of s_i over tokens, ``actor/seq_log_ratio_mean``, ``actor/ppo_kl``
    (k3 of the token ratios) and ``actor/pg_loss``.
    """
    _check(log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_weights, dual_clip=False)
    advantages, mask, log_ratio = _setup(log_probs, old_log_probs, advantages, loss_mask)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = (log_ratio.sum(-1, keepdim=True) / lengths).detach()  # [B, 1]: mean_t log r
    token_log_ratio = masked(log_probs - log_probs.detach(), mask) + seq_log_ratio
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO))  # s_i,t: s_i in value
    per_token, high, low = _clipped_surrogate(ratio, advantages, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss, metrics, tmean = _reduce(per_token, mask, loss_agg_mode, is_weights, **denominators)
    with torch.no_grad():
        clamped = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        metrics.update({
            "actor/pg_clipfrac_high": tmean(high),
            "actor/pg_clipfrac_low": tmean(low),
            "actor/ratio_mean": tmean(ratio),
            "actor/ratio_max": masked(ratio, mask).max(),
            "actor/seq_log_ratio_mean": tmean(seq_log_ratio.expand_as(mask)),
            "actor/ppo_kl": tmean(torch.exp(clamped) - 1.0 - clamped),
        })
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def compute_cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    **denominators: float | int | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5): the loss -sg[clip(r, 1 - low, 1 + high)] x A x
    log pi_theta, token-level: the importance weight is clipped and detached, never the token, so
    every token keeps a gradient (-sg[w] x A at its log-prob), the rare high-ratio "reflection"
    tokens included. The paper sets no lower bound (clip_ratio_low = 1 here: 1 - low = 0).

    Arguments as ``compute_policy_loss`` (``clip_ratio_c`` must be None). Metrics:
    ``actor/pg_clipfrac_high`` / ``_low`` (the weight capped above / raised below, whatever the
    advantage's sign: the gradient stays), ``actor/is_weight_mean`` (token mean of the clipped
    weight), ``actor/ratio_mean`` / ``_max``, ``actor/ppo_kl`` and ``actor/pg_loss``.
    """
    _check(log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_weights, dual_clip=False)
    advantages, mask, log_ratio = _setup(log_probs, old_log_probs, advantages, loss_mask)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    per_token = -weight * advantages * masked(log_probs, mask)
    loss, metrics, tmean = _reduce(per_token, mask, loss_agg_mode, is_weights, **denominators)
    with torch.no_grad():
        metrics.update({
            "actor/pg_clipfrac_high": tmean(ratio > 1.0 + clip_ratio_high),
            "actor/pg_clipfrac_low": tmean(ratio < 1.0 - clip_ratio_low),
            "actor/is_weight_mean": tmean(weight),
            "actor/ratio_mean": tmean(ratio),
            "actor/ratio_max": masked(ratio, mask).max(),
            "actor/ppo_kl": tmean(ratio - 1.0 - log_ratio),
        })
    return loss, metrics


def get_policy_loss_fn(name: str):
    """The policy-loss function registered as ``name`` (ValueError listing the valid names)."""
    return POLICY_LOSSES.get(name)
