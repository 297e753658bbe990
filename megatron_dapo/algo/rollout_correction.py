"""Rollout correction: importance weights and rejection masks for responses sampled by a policy other
than the trainer's pi_old (the engine's numerics, stale weights, partial rollouts).

Shapes: B = responses, T = response length (padded); every tensor is [B, T]. The log-ratio of a token
is log rho = log pi_old - log pi_rollout (the trainer's over the engine's), taken only under the mask.

Importance weights (``rollout_is``), detached, multiply each token's loss:
  token     w_t = rho_t                      (TIS: truncated above; biased, low variance)
  sequence  w_t = prod_t' rho_t' for all t   (unbiased, high variance)
  each either truncated above at ``is_upper`` (TIS) or, with ``is_lower`` (IcePop), set to 0 outside
  [is_lower, is_upper].
Rejection (``rejections``) masks tokens out of the loss (and out of its token count) where a
divergence estimate leaves its bounds: k1 = -log rho (bounds on log rho's ratio: lower and upper),
k2 = (log rho)^2 / 2 and k3 = rho - 1 - log rho (upper only), per token, or per response as their
sum, mean (mean k1 is the geometric-mean ratio) or max; every criterion must pass. Names and
semantics are verl 0.9.1's ``algorithm.rollout_correction`` (rollout_corr_helper.py), so a verl
user's settings mean the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dapo.algo.aggregation import masked
# log-ratios are clamped to +-20 before exp, as the losses' (and verl's SAFETY_BOUND)
from megatron_dapo.algo.losses import MAX_LOG_RATIO

REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                     "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class Rejection:
    """One rejection criterion: ``option`` (REJECTION_OPTIONS) and its bounds. k1 options bound the
    ratio (lower, upper: log bounds are their logs); k2 / k3 bound the divergence above only."""

    option: str
    upper: float
    lower: float | None = None


@dataclass(frozen=True)
class CorrectionSpec:
    """What to correct: importance weights at ``is_level`` ("token", "sequence" or None), truncated at
    ``is_upper`` or, with ``is_lower``, IcePop's [is_lower, is_upper] mask; and rejection criteria."""

    is_level: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    rejections: tuple[Rejection, ...] = ()

    @property
    def active(self) -> bool:
        return self.is_level is not None or bool(self.rejections)


@dataclass(frozen=True)
class Correction:
    """``weights``: [B, T] detached importance weights (None without rollout_is), 0 under the mask;
    ``mask``: [B, T] the loss mask with rejected tokens set to 0; ``metrics``: 0-d detached tensors."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number (TIS cap) or "lower_upper" (IcePop) -> (upper, lower)."""
    if isinstance(spec, bool):
        raise ValueError(f"rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
    lower: float | None = None
    if isinstance(spec, str) and "_" in spec:
        low_text, high_text = spec.split("_", 1)
        lower = _number(low_text, "rollout_is_threshold", spec)
        upper = _number(high_text, "rollout_is_threshold", spec)
    else:
        upper = _number(spec, "rollout_is_threshold", spec)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={spec!r}: need an upper bound > 0 and, for IcePop, "
                         "0 < lower <= upper (e.g. 2.0, or '0.5_5.0')")
    return upper, lower


def parse_rejections(options: str, thresholds: float | str | None) -> tuple[Rejection, ...]:
    """verl's ``rollout_rs`` ("token_k1,seq_mean_k3") and ``rollout_rs_threshold`` (one value for all, or
    one per option, comma separated; k1 options take "lower_upper" or an upper whose reciprocal is the
    lower) -> the criteria, duplicates dropped."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [n for n in names if n not in REJECTION_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs={options!r}: options are {', '.join(REJECTION_OPTIONS)} (comma separated)")
    if thresholds is None:
        raise ValueError(f"rollout_rs={options!r} needs rollout_rs_threshold (one value, or one per option)")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold={thresholds!r}: give one value or {len(names)} (one per option)")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs):
        if name.endswith("k1"):
            low_text, _, high_text = spec.rpartition("_") if "_" in spec else ("", "", spec)
            upper = _number(high_text, "rollout_rs_threshold", spec)
            # an upper alone: its reciprocal is the lower bound (verl's rule)
            lower = _number(low_text, "rollout_rs_threshold", spec) if low_text else 1.0 / upper if upper > 0 else 0.0
            if not 0 < lower <= upper:
                raise ValueError(f"rollout_rs_threshold={spec!r} for {name}: need 0 < lower <= upper")
            out.append(Rejection(name, upper, lower))
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold={spec!r} for {name}: one upper bound, no '_'")
            upper = _number(spec, "rollout_rs_threshold", spec)
            if not upper > 0:
                raise ValueError(f"rollout_rs_threshold={spec!r} for {name}: need a bound > 0")
            out.append(Rejection(name, upper))
    return tuple(out)


def _number(text, key: str, spec) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={spec!r}: {text!r} is not a number") from None


def _seq(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """[B, T] -> [B] per response: the masked sum, mean or max (0 for a response with no valid token)."""
    valid = mask > 0
    if how == "sum":
        return masked(values, mask).sum(-1)
    if how == "mean":
        return masked(values, mask).sum(-1) / valid.sum(-1).clamp(min=1)
    top = torch.where(valid, values, torch.full_like(values, -math.inf)).amax(-1)
    return torch.where(valid.any(-1), top, torch.zeros_like(top))


def _keep(rule: Rejection, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the tokens ``rule`` keeps (a sequence rule keeps or drops a whole response)."""
    stats = {"k1": -log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": torch.exp(log_ratio) - 1.0 - log_ratio}
    level, _, kind = rule.option.rpartition("_")
    stat = stats[kind]
    if level != "token":
        stat = _seq(stat, mask, level.removeprefix("seq_"))[:, None].expand_as(log_ratio)
    if kind == "k1":
        return (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    return stat <= rule.upper


def correct(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
            spec: CorrectionSpec) -> Correction:
    """The importance weights, the rejection mask and their metrics for a batch of responses (module
    docstring). Metrics ("rollout_corr/..."): kl (mean log pi_rollout - log pi_old), k3_kl, chi2_token
    (E[rho^2] - 1), chi2_seq (E_seq[prod rho^2] - 1), and with weights is_mean / is_std / is_max /
    is_min (over valid tokens), is_frac_high / is_frac_low (the raw weight past its bounds), ess (the
    effective sample size fraction 1 / E[(w / E w)^2]); with rejection token_masked_frac and
    seq_masked_frac (responses with at least one token rejected)."""
    valid = mask > 0
    n_tok = valid.sum().clamp(min=1)
    log_ratio = masked(old_log_probs.to(torch.float64) - rollout_log_probs.to(torch.float64), mask)
    safe = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    def tmean(x):
        return masked(x, mask).sum() / n_tok

    seqs = valid.any(-1)
    seq_log = log_ratio.sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # log prod rho, then clamped (as verl)
    metrics = {
        "rollout_corr/kl": tmean(-log_ratio),
        "rollout_corr/k3_kl": tmean(torch.exp(safe) - safe - 1.0),
        "rollout_corr/chi2_token": tmean(torch.exp(2 * safe)) - 1.0,
        "rollout_corr/chi2_seq": (torch.exp(2 * seq_log)[seqs].mean() if seqs.any() else seq_log.new_tensor(1.0))
                                 - 1.0,
    }
    weights = None
    if spec.is_level is not None:
        level_log = safe if spec.is_level == "token" else seq_log[:, None].expand_as(safe)
        raw = masked(torch.exp(level_log), mask)
        if spec.is_lower is None:
            weights = raw.clamp(max=spec.is_upper)
        else:
            weights = torch.where((raw >= spec.is_lower) & (raw <= spec.is_upper), raw, torch.zeros_like(raw))
        weights = masked(weights, mask)
        lower = spec.is_lower if spec.is_lower is not None else 1.0 / spec.is_upper
        mean = tmean(weights)
        metrics |= {
            "rollout_corr/is_mean": mean,
            "rollout_corr/is_std": (tmean(weights ** 2) - mean ** 2).clamp(min=0).sqrt(),
            "rollout_corr/is_max": torch.where(valid, weights, torch.full_like(weights, -math.inf)).max(),
            "rollout_corr/is_min": torch.where(valid, weights, torch.full_like(weights, math.inf)).min(),
            "rollout_corr/is_frac_high": tmean((raw > spec.is_upper).to(raw.dtype)),
            "rollout_corr/is_frac_low": tmean((raw < lower).to(raw.dtype)),
            "rollout_corr/ess": 1.0 / tmean((weights / mean.clamp(min=1e-12)) ** 2).clamp(min=1e-12),
        }
    keep = torch.ones_like(valid)
    for rule in spec.rejections:
        keep &= _keep(rule, safe, mask)
    new_mask = torch.where(keep, mask, torch.zeros_like(mask))
    if spec.rejections:
        rejected = valid & ~keep
        metrics["rollout_corr/token_masked_frac"] = tmean(rejected.to(torch.float64))
        metrics["rollout_corr/seq_masked_frac"] = (rejected.any(-1)[seqs].to(torch.float64).mean()
                                                   if seqs.any() else log_ratio.new_zeros(()))
    if weights is not None:
        weights = weights.to(old_log_probs.dtype)
    return Correction(weights=weights, mask=new_mask, metrics={k: v.detach() for k, v in metrics.items()})
