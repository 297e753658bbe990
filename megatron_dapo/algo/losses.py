"""DAPO policy loss: Clip-Higher surrogate, optional dual clip, token-level aggregation.

Shapes: B = sequences in this micro-batch, T = response length (padded). Every tensor argument is
[B, T]; ``advantages`` may also be [B] (one value per sequence, broadcast over its tokens).

Exact token-mean under gradient accumulation and data parallelism: the paper's loss is
sum(per-token loss) / (number of valid tokens of the whole mini-batch). Each micro-batch on each
rank therefore divides its own token sum by the *global* count (``global_num_tokens``), and the
sum of those micro-batch losses over micro-batches and ranks is the mini-batch loss. Dividing by
the local count (verl's legacy actor) only approximates it.

Metrics follow the same convention: mean-type metrics are divided by the same denominator as the
loss, so summing them over micro-batches and DP ranks gives the mini-batch mean; keys ending in
``_max`` reduce with max. They are detached 0-d tensors (no host sync in the micro-batch path).

Truncated importance sampling (TIS, for the rollout engine / trainer mismatch): the responses
were sampled from pi_rollout (the engine's log-probs), while the ratio's pi_old comes from the
trainer's forward; with bf16 / FP8 or other kernels the two differ. Each token's loss is then
weighted by w = min(pi_old / pi_rollout, tis_cap), detached, before aggregation. Since w > 0 it
commutes with the clips, so this equals the plain loss with advantages w * A.
"""

import torch

from megatron_dapo.registry import Registry

# Clamp |log(pi / pi_old)| before exp() so that a large trainer/rollout mismatch cannot overflow
# to inf and poison the step with NaN. exp(20) ~ 4.9e8 is far outside any clip range, so the clamp
# never changes a value that the clip would let through.
MAX_LOG_RATIO = 20.0

AGG_MODES: Registry = Registry("loss_agg_mode")
POLICY_LOSSES: Registry = Registry("policy loss")


def _denominator(local: torch.Tensor, global_count: float | int | torch.Tensor | None) -> torch.Tensor:
    count = local if global_count is None else torch.as_tensor(global_count, dtype=local.dtype)
    # An all-masked micro-batch contributes 0, not NaN.
    return count.clamp(min=1.0)


@AGG_MODES.register("token-mean")
def _token_mean(values, mask, global_num_tokens=None, global_num_seqs=None):
    """sum over all valid tokens / number of valid tokens (DAPO, Eq. 12)."""
    return (values * mask).sum() / _denominator(mask.sum(), global_num_tokens)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(values, mask, global_num_tokens=None, global_num_seqs=None):
    """mean over sequences of each sequence's token mean (GRPO's sample-level loss)."""
    lengths = mask.sum(-1)
    per_seq = (values * mask).sum(-1) / lengths.clamp(min=1.0)
    return per_seq.sum() / _denominator((lengths > 0).to(values.dtype).sum(), global_num_seqs)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(values, mask, global_num_tokens=None, global_num_seqs=None):
    """mean over sequences of each sequence's token sum."""
    lengths = mask.sum(-1)
    per_seq = (values * mask).sum(-1)
    return per_seq.sum() / _denominator((lengths > 0).to(values.dtype).sum(), global_num_seqs)


def aggregate(values, mask, mode, *, global_num_tokens=None, global_num_seqs=None) -> torch.Tensor:
    """Reduce a [B, T] per-token tensor to a scalar with the named mode (see ``AGG_MODES``)."""
    return AGG_MODES.get(mode)(values, mask, global_num_tokens, global_num_seqs)


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
    global_num_tokens: float | int | torch.Tensor | None = None,
    global_num_seqs: float | int | torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss with decoupled clip ranges (Clip-Higher).

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
        loss_agg_mode: "token-mean" (DAPO), "seq-mean-token-mean", "seq-mean-token-sum".
        global_num_tokens: denominator of "token-mean": valid tokens of the whole mini-batch
            across micro-batches and DP ranks. None uses this micro-batch's count.
        global_num_seqs: denominator of the seq-mean modes, likewise (sequences with >= 1 valid
            token). None uses this micro-batch's count.
        rollout_log_probs: [B, T] log pi_rollout of the same tokens as reported by the rollout
            engine (no gradient); required when ``tis_cap`` is set, ignored otherwise.
        tis_cap: truncated importance sampling: each token's loss is multiplied by
            w = min(exp(old_log_probs - rollout_log_probs), tis_cap), detached. None disables it
            (the loss is then bit-identical to the plain one); it must be >= 1.

    Returns:
        (loss, metrics): a 0-d loss and detached 0-d metric tensors: ``actor/pg_clipfrac_high``
        (A > 0 and ratio above 1 + high), ``actor/pg_clipfrac_low`` (A < 0 and ratio below
        1 - low), ``actor/pg_clipfrac_dual`` (A < 0 and ratio above c), ``actor/ratio_mean``,
        ``actor/ratio_max``, ``actor/ppo_kl`` (k3 estimate of KL(pi_old || pi_theta)) and
        ``actor/pg_loss``. Tokens counted in a clip fraction get exactly zero gradient. With
        TIS also ``actor/tis_clip_frac`` (valid tokens whose pi_old / pi_rollout exceeded the cap)
        and ``actor/tis_weight_mean`` (token-mean of w).
    """
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                         f"{clip_ratio_low}, {clip_ratio_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable), got {clip_ratio_c}")
    if tis_cap is not None:
        if not tis_cap >= 1.0:
            raise ValueError(f"tis_cap must be >= 1 (or None to disable TIS), got {tis_cap}")
        if rollout_log_probs is None:
            raise ValueError("tis_cap is set but rollout_log_probs is None: truncated importance sampling "
                             "needs the rollout engine's log-probs of the response tokens")
        if rollout_log_probs.shape != log_probs.shape:
            raise ValueError(f"rollout_log_probs must have the shape of log_probs {tuple(log_probs.shape)}, "
                             f"got {tuple(rollout_log_probs.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = loss_mask.to(log_probs.dtype)

    log_ratio = (log_probs - old_log_probs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    if tis_cap is not None:
        with torch.no_grad():  # w is a fixed per-token weight, not part of the objective
            # exp may overflow to inf for a huge mismatch; the min with the cap keeps w finite.
            tis_ratio = torch.exp(old_log_probs.to(per_token.dtype) - rollout_log_probs.to(per_token.dtype))
            tis_weight = tis_ratio.clamp(max=tis_cap)
        per_token = per_token * tis_weight

    agg = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    loss = aggregate(per_token, mask, loss_agg_mode, **agg)

    with torch.no_grad():
        valid = mask > 0
        high = (advantages > 0) & (ratio > 1.0 + clip_ratio_high)
        low = (advantages < 0) & (ratio < 1.0 - clip_ratio_low)
        # Token-mean of the metrics, with the loss's denominator (see the module docstring).
        def tmean(x):
            return aggregate(x.to(mask.dtype), mask, "token-mean", global_num_tokens=global_num_tokens)

        metrics = {
            "actor/pg_loss": loss.detach().clone(),
            "actor/pg_clipfrac_high": tmean(high),
            "actor/pg_clipfrac_low": tmean(low),
            "actor/pg_clipfrac_dual": tmean(dual),
            "actor/ratio_mean": tmean(ratio),
            "actor/ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max(),
            "actor/ppo_kl": tmean(ratio - 1.0 - log_ratio),
        }
        if tis_cap is not None:
            metrics["actor/tis_clip_frac"] = tmean(tis_ratio > tis_cap)
            metrics["actor/tis_weight_mean"] = tmean(tis_weight)
    return loss, metrics


def get_policy_loss_fn(name: str):
    """The policy-loss function registered as ``name`` (ValueError listing the valid names)."""
    return POLICY_LOSSES.get(name)
