"""An update's metrics: summed (or maxed) over this rank's micro-batches, then exchanged over DP once
per step for all its updates (``PendingMetrics``, ``reduce_metrics``).

The loss's metrics are pre-divided by the global count, so they are summed over micro-batches
(``*_max`` keys: max) on the last pipeline stage, then all ranks exchange one stacked tensor (one
all-gather over DP, reduced locally: sum or max per key) and the last stage broadcasts the result
over PP. The output layer's hint-check outcomes (logprobs.SHORTCUT_STATS, counted on the last
stage) ride in the same exchange as two more sum keys, so every rank reports the same
``actor/grad_shortcut_used`` / ``_fallbacks``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.batching import MicroBatch, response_mask
from megatron_dapo.mcore.logprobs import ShortcutStats
from megatron_dapo.mcore.parallel import all_gather_rows
from megatron_dapo.mcore.step_settings import StepSettings, compute_device


# The engine/trainer mismatch measured in an update's forward (train.old_log_probs=rollout: no
# old-log-prob pass computes the trainer's side): per-micro-batch partial sums over response tokens,
# reduced with the loss's metrics and turned into weight_sync.logprob_mismatch's three figures.
MISMATCH_SUMS = ("rollout/_mismatch_expm1_sum", "rollout/_mismatch_abs_sum", "rollout/_mismatch_tokens")
MISMATCH_MAX = ("rollout/logprob_abs_diff_max",)


def mismatch_sums(mb: MicroBatch, log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """[b, s] trainer log-probs against the micro-batch's rollout log-probs, on its response positions."""
    span = response_mask(mb).to(log_probs.device)
    diff = (mb.rollout_log_probs.to(log_probs.device) - log_probs).abs() * span
    return dict(zip(MISMATCH_SUMS + MISMATCH_MAX, (torch.expm1(diff).sum(), diff.sum(), span.sum(), diff.max())))


def _finish_mismatch(metrics: dict[str, torch.Tensor]) -> None:
    """The reduced sums -> rollout/logprob_mismatch (mean exp|d|) and rollout/logprob_abs_diff_mean."""
    expm1, absolute, tokens = (metrics.pop(k) for k in MISMATCH_SUMS)
    tokens = tokens.clamp(min=1.0)
    metrics["rollout/logprob_mismatch"] = expm1 / tokens + 1.0
    metrics["rollout/logprob_abs_diff_mean"] = absolute / tokens


@functools.lru_cache(maxsize=8)
def _metric_keys(settings: StepSettings) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sum-reduced keys, max-reduced keys) of the loss's metrics, from a 1-token dry run, so
    that every rank (also those without the loss) sizes the exchange buffers alike."""
    one = torch.zeros(1, 1)
    _, metrics = settings.policy_loss_fn()(one, one, one, torch.ones(1, 1), global_num_tokens=1.0,
                                           global_num_seqs=1.0)
    keys = sorted(metrics) + ["actor/entropy"]
    return tuple(k for k in keys if not k.endswith("_max")), tuple(k for k in keys if k.endswith("_max"))


# Hinted output-layer backwards of an update that took the forward's gradients / recomputed
# (logprobs.ShortcutStats); summed like the loss's metrics, over micro-batches and DP ranks.
SHORTCUT_KEYS = ("actor/grad_shortcut_used", "actor/grad_shortcut_fallbacks")


@dataclass
class PendingMetrics:
    """An update's metrics before their exchange over DP: this rank's sums and maxima over its
    micro-batches (``local``: ``sum_keys`` then ``max_keys``; zeros off the last pipeline stage),
    and what every rank already holds alike (``known``: counts, grad norm, lr). ``reduce_metrics``
    exchanges a whole list of them in one all-gather."""

    local: torch.Tensor  # [len(sum_keys) + len(max_keys)] fp32
    sum_keys: tuple[str, ...]
    max_keys: tuple[str, ...]
    num_loss_sums: int  # sum_keys[:num_loss_sums] are the loss's; the rest the shortcut counts
    mismatch: bool
    known: dict[str, torch.Tensor]


def local_metrics(per_mb: list[dict], settings: StepSettings, shortcut: ShortcutStats,
                   mismatch: bool = False) -> PendingMetrics:
    """Sum (or max) over this rank's micro-batches. ``shortcut``: this rank's hint-check counts of
    the update, appended to the sum keys (filled on the device: no host-to-device copy)."""
    loss_sum_keys, max_keys = _metric_keys(settings)
    if mismatch:
        loss_sum_keys, max_keys = loss_sum_keys + MISMATCH_SUMS, max_keys + MISMATCH_MAX
    sum_keys = loss_sum_keys + SHORTCUT_KEYS
    local = torch.zeros(len(sum_keys) + len(max_keys), dtype=torch.float32, device=compute_device())
    if per_mb:  # the last pipeline stage
        counts = [torch.full((), float(n), device=local.device) for n in (shortcut.used, shortcut.fallbacks)]
        local.copy_(torch.stack([torch.stack([m[k] for m in per_mb]).sum() for k in loss_sum_keys] + counts
                                + [torch.stack([m[k] for m in per_mb]).max() for k in max_keys]))
    return PendingMetrics(local, sum_keys, max_keys, len(loss_sum_keys), mismatch, {})


def reduce_metrics(pending: list[PendingMetrics]) -> list[dict[str, float]]:
    """Each update's metrics, equal on every rank: one all-gather over DP for the whole list (sum or
    max per key), then the last stage's values to every PP rank (one broadcast). The loop defers a
    step's updates to here: one exchange a step instead of one an update, which was a visible share
    of an update at DP=2 on the CPU demo (docs/peer_trl.md)."""
    if not pending:
        return []
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    table = all_gather_rows(torch.cat([p.local for p in pending]), ps.get_data_parallel_group())  # [DP, sum of sizes]
    parts, at = [], 0
    for p in pending:
        t = table[:, at:at + p.local.numel()]
        at += p.local.numel()
        n = len(p.sum_keys)
        reduced = torch.cat([t[:, :n].sum(0), t[:, n:].amax(0)])
        # Per DP rank, as actor/num_micro_batches: a count that does not grow with the DP size.
        reduced[p.num_loss_sums:n] = reduced[p.num_loss_sums:n] / t.shape[0]
        parts.append(reduced)
    flat = torch.cat(parts)
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    out = []
    for p, reduced in zip(pending, torch.split(flat, [p.local.numel() for p in pending])):
        metrics = dict(zip(p.sum_keys + p.max_keys, reduced))
        if p.mismatch:
            _finish_mismatch(metrics)
        metrics.update(p.known)
        values = torch.stack([v.detach().float().cpu() for v in metrics.values()]).tolist()
        out.append(dict(zip(metrics, values)))
    return out
