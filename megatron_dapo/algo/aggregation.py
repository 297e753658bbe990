"""Reducing a [B, T] per-token loss to the scalar whose gradient the update uses (``loss_agg_mode``).

Shapes: B = sequences in this micro-batch, T = response length (padded); ``values`` and ``mask``
are [B, T].

Exact means under gradient accumulation and data parallelism: each mode's denominator is the
*whole mini-batch's* (valid tokens, or sequences with at least one valid token), counted across
micro-batches and DP ranks and passed in (``global_num_tokens`` / ``global_num_seqs``). Summing
the micro-batch results over micro-batches and ranks then gives the mini-batch's value. None uses
this micro-batch's own count (a single micro-batch).

Values under a zero of the mask never reach a sum, NaN or inf included: they are selected away
(``torch.where``), not multiplied by zero (NaN x 0 is NaN).
"""

import torch

from megatron_dapo.registry import Registry

AGG_MODES: Registry = Registry("loss_agg_mode")


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] values where mask > 0, exactly 0 elsewhere (whatever was there)."""
    return torch.where(mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _weighted(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] values x mask where mask > 0 (a 0/1 mask: the values themselves), exactly 0 elsewhere: a
    fractional mask weighs its tokens, in the sums and in the counts alike."""
    return masked(values * mask, mask)


def _denominator(local: torch.Tensor, global_count: float | int | torch.Tensor | None) -> torch.Tensor:
    count = local if global_count is None else torch.as_tensor(global_count, dtype=local.dtype)
    # An all-masked micro-batch contributes 0, not NaN.
    return count.clamp(min=1.0)


def _valid_seqs(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((mask > 0).sum(-1) > 0).to(dtype).sum()


@AGG_MODES.register("token-mean")
def _token_mean(values, mask, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    """sum over all valid tokens / number of valid tokens (DAPO, Eq. 12)."""
    return _weighted(values, mask).sum() / _denominator(_weighted(torch.ones_like(values), mask).sum(),
                                                        global_num_tokens)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(values, mask, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    """mean over sequences of each sequence's token mean (GRPO's sample-level loss; GSPO's)."""
    lengths = _weighted(torch.ones_like(values), mask).sum(-1)
    per_seq = _weighted(values, mask).sum(-1) / lengths.clamp(min=1.0)
    return per_seq.sum() / _denominator(_valid_seqs(mask, values.dtype), global_num_seqs)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(values, mask, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    """mean over sequences of each sequence's token sum."""
    per_seq = _weighted(values, mask).sum(-1)
    return per_seq.sum() / _denominator(_valid_seqs(mask, values.dtype), global_num_seqs)


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(values, mask, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    """Dr. GRPO (arXiv 2503.20783, Eq. 3): seq-mean-token-sum divided by one constant, the generation
    budget (``loss_scale_factor``; the config passes data.max_response_length): no per-response
    length in any denominator, so a long wrong answer is not pushed down less per token than a short
    one. Required: verl's fallback, the padded width of the batch, changes from batch to batch here."""
    if loss_scale_factor is None or not loss_scale_factor > 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a constant loss_scale_factor > 0 (the generation "
                         f"budget in tokens), got {loss_scale_factor}")
    return _seq_mean_token_sum(values, mask, global_num_tokens, global_num_seqs) / loss_scale_factor


def aggregate(values, mask, mode, *, global_num_tokens=None, global_num_seqs=None,
              loss_scale_factor=None) -> torch.Tensor:
    """Reduce a [B, T] per-token tensor to a scalar with the named mode (see ``AGG_MODES``)."""
    return AGG_MODES.get(mode)(values, mask, global_num_tokens, global_num_seqs, loss_scale_factor)
