"""Rollout correction of a step's samples (algorithm.rollout_correction): once per step, after pi_old is
known and before the updates, on the whole batch alike on every rank.

Each sample gets its importance weights (``Sample.is_weights``, which the loss multiplies in) and its
loss mask with the rejected tokens set to 0, so the mini-batches' token counts (train_step.batch_counts)
leave them out, as verl's response mask does. The math is algo/rollout_correction.py's; here the
ragged samples become one padded [B, T] batch and back."""

from __future__ import annotations

import dataclasses

import torch

from megatron_dapo.algo.rollout_correction import CorrectionSpec, correct
from megatron_dapo.batching import Sample


def correct_samples(samples: list[Sample], spec: CorrectionSpec) -> tuple[list[Sample], dict[str, float]]:
    """(the samples with is_weights and rejection applied, the step's rollout_corr/* metrics); the samples
    as they are and {} when ``spec`` asks for nothing. Every sample needs its rollout log-probs (a
    ValueError naming the first ones and the fix, alike on every rank: all hold the same batch)."""
    if not spec.active or not samples:
        return samples, {}
    missing = [i for i, x in enumerate(samples) if x.rollout_log_probs is None or x.old_log_probs is None]
    if missing:
        raise ValueError(f"algorithm.rollout_correction needs the engine's and the trainer's log-probs of every "
                         f"response; samples {missing[:8]} lack them (the engine reported none?); set "
                         "algorithm.rollout_correction.rollout_is=null and rollout_rs=null, or use an engine that "
                         "returns log-probs")
    lengths = [x.num_response_tokens for x in samples]
    b, t = len(samples), max(lengths, default=0)
    old, rollout, mask = (torch.zeros(b, t, dtype=torch.float64) for _ in range(3))
    for i, x in enumerate(samples):
        n = lengths[i]
        old[i, :n], rollout[i, :n] = x.old_log_probs.double(), x.rollout_log_probs.double()
        mask[i, :n] = 1.0 if x.loss_mask is None else x.loss_mask.double()
    result = correct(old, rollout, mask, spec)
    out = []
    for i, x in enumerate(samples):
        n = lengths[i]
        changes = {}
        if result.weights is not None:
            changes["is_weights"] = result.weights[i, :n].float()
        if spec.rejections:
            changes["loss_mask"] = result.mask[i, :n].float()
        out.append(dataclasses.replace(x, **changes))
    return out, {k: float(v) for k, v in result.metrics.items()}
