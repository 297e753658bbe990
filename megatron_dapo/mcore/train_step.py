"""One optimizer update over a mini-batch, and the forward-only log-prob pass, through megatron's schedules.

The loss. Every micro-batch on every DP rank calls the policy loss (algo/losses.py) with the
valid-token count of the *whole* mini-batch (``global_num_tokens``, and ``global_num_seqs`` for
the seq-mean modes), all-gathered over DP before the schedule runs. The sum of those
micro-batch losses over micro-batches and DP ranks is then the mini-batch token-mean, and its
gradient is what the update must use. With rollout correction (algorithm.rollout_correction) the
loss also gets each micro-batch's importance weights (``MicroBatch.is_weights``), which the loop
computed for the whole batch from the samples' rollout log-probs (megatron_dapo/off_policy.py).

The scaling megatron-core 0.19.2 applies on the way, with ``calculate_per_token_loss=False``
(TransformerConfig's default; optimizer.py refuses the other) and a loss_func returning
``(loss, metrics)``:
  1. schedules.py:340-341 (forward_step_calc_loss): ``loss *= cp_size; loss /= num_microbatches``,
     in place, before backward;
  2. distributed_data_parallel.py:212 with param_and_grad_buffer.py:661: DDP multiplies each
     gradient by 1 / (DP x CP) and then sums it over the DP x CP group (SUM, line 664);
  3. finalize_model_grads.py:680: scales by 1 / num_tokens only when calculate_per_token_loss
     is set (not here); otherwise it adds no scaling (the tied-embedding all-reduce over the
     first and last stage, :659, sums the two copies' grads).
So the reduced gradient is sum_{dp, cp, mb} CP / (M x DP x CP) x d loss_mb = (1 / (M x DP))
x d(mini-batch loss); each micro-batch loss is multiplied by M x DP before it is returned, and the
gradient becomes exactly d(global token-mean) / d theta. (Megatron's own per-token path, a
3-tuple with calculate_per_token_loss=True, divides by a token count that finalize_model_grads
sums over DP; the pre-divided loss here also covers the seq-mean modes.)

The output layer. For token-mean (a sum of per-token terms over the global count) the forward
hands logprobs.py a hint, ``_loss_grad_hint``: the loss's gradient at a chunk's log-probs, from
those log-probs alone. The fused output layer then computes its input and weight gradients while
each chunk's logits exist instead of recomputing them in backward, a quarter less output-layer
work, and skips positions outside the loss mask; backward checks that the gradient that arrived
is the hint times one scalar (the scaling above) and recomputes otherwise.

Metrics: the loss's metrics are pre-divided by the global count, so they are summed over
micro-batches (``*_max`` keys: max) on the last pipeline stage, then all ranks exchange one
stacked tensor (one all-gather over DP, reduced locally: sum or max per key) and the last
stage broadcasts the result over PP; the training loop defers this to the end of the step, one
exchange for all its updates (``defer_metrics``, ``reduce_metrics``), and gathers the step's token
counts ahead of its updates in one exchange too (``batch_counts``). One host sync per step for the
metrics, and one per micro-batch in the output layer's backward (the hint check). The hint
check's outcomes (logprobs.SHORTCUT_STATS, counted on the last stage) ride in the same exchange
as two more sum keys, so every rank reports the same ``actor/grad_shortcut_used`` / ``_fallbacks``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.algo import get_policy_loss_fn
from megatron_dapo.config import DAPOConfig
from megatron_dapo.batching import (
    MicroBatch,
    Sample,
    count_micro_batches,
    make_micro_batches,
    pad_multiple,
    padding_mask,
    response_mask,
    uniform_shape,
    unpack_responses,
)
from megatron_dapo.mcore.logprobs import SHORTCUT_STATS, GradHint, ShortcutStats, logprobs_output_processor
from megatron_dapo.mcore.moe import (
    AGREEMENT, TokenOutputs, clear_replay, moe_metrics, replay, stage_padding_mask, without_router_losses,
)
from megatron_dapo.mcore.optimizer import current_lr
from megatron_dapo.mcore.parallel import all_gather_rows


@dataclass(frozen=True)
class StepSettings:
    """What the step needs from the config, resolved once (see ``from_config``)."""

    policy_loss: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    loss_agg_mode: str
    temperature: float  # the rollout temperature: log-probs must be those of the sampler
    valid_vocab_size: int  # the real vocabulary; padded rows are excluded from the softmax
    max_tokens_per_micro_batch: int
    micro_batch_size: int
    pad_multiple: int
    chunk_tokens: int | None = None  # log-prob chunking; None = logprobs.py's memory default
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant (Dr. GRPO)

    @classmethod
    def from_config(cls, cfg: DAPOConfig, vocab_size: int) -> "StepSettings":
        p, loss = cfg.parallel, cfg.loss_settings()
        return cls(policy_loss=loss.policy_loss, clip_ratio_low=loss.clip_ratio_low,
                   clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c,
                   loss_agg_mode=loss.loss_agg_mode, loss_scale_factor=loss.loss_scale_factor,
                   temperature=cfg.rollout.temperature,
                   valid_vocab_size=vocab_size,
                   max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                   micro_batch_size=cfg.train.micro_batch_size,
                   chunk_tokens=cfg.train.logprob_chunk_tokens or None,
                   pad_multiple=pad_multiple(tensor_parallel=p.tensor_model_parallel_size,
                                             sequence_parallel=p.sequence_parallel,
                                             context_parallel=p.context_parallel_size,
                                             fp8=cfg.model.fp8 is not None))

    def policy_loss_fn(self):
        norm = {} if self.loss_scale_factor is None else {"loss_scale_factor": self.loss_scale_factor}
        return functools.partial(get_policy_loss_fn(self.policy_loss), clip_ratio_low=self.clip_ratio_low,
                                 clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c,
                                 loss_agg_mode=self.loss_agg_mode, **norm)


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups():
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()


def _pp_last_rank() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_last_rank()


def _batching(model, settings: StepSettings) -> dict:
    config = model[0].config
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    return dict(max_tokens=settings.max_tokens_per_micro_batch, micro_batch_size=settings.micro_batch_size,
                multiple=settings.pad_multiple,
                count_multiple=pp if vpp else 1,  # the interleaved schedule needs M % PP == 0
                # stages that cannot exchange shapes, or EP ranks gathering each other's tokens
                uniform=(pp > 1 and not config.variable_seq_lengths) or _same_shape_over_dp(config))


def _same_shape_over_dp(config) -> bool:
    """Whether every data-parallel rank must run micro-batches of one [b, s]: megatron's allgather token
    dispatcher gathers the hidden states of the EP ranks (taken from the DP ranks) in every MoE layer,
    which needs as many tokens on each. Under expert parallelism the DP ranks also run as many micro-batches
    (each MoE layer's forward is a collective), which ``_micro_batches`` and ``compute_log_probs`` agree on."""
    return config.expert_model_parallel_size > 1 and config.moe_token_dispatcher_type == "allgather"


def _local_counts(model, samples: list[Sample], settings: StepSettings) -> torch.Tensor:
    """[5] float64: this DP rank's (valid tokens, valid sequences, micro-batches, samples, longest sample's
    tokens) for ``samples``, from the samples (their loss masks: rollout correction's rejections
    included) and the micro-batch plan."""
    valid = [float(x.loss_mask.sum()) if x.loss_mask is not None else float(x.num_response_tokens)
             for x in samples]
    return torch.tensor([sum(valid), sum(1.0 for v in valid if v > 0),
                         float(count_micro_batches(samples, **_batching(model, settings))), float(len(samples)),
                         float(max((x.num_tokens for x in samples), default=0))], dtype=torch.float64)


def _dp_agreement(model, table: torch.Tensor, kwargs: dict) -> tuple[int, int]:
    """(micro-batches, uniform length) every DP rank uses, from the ranks' ``_local_counts`` rows ``table``:
    the most micro-batches any rank needs; under ``_same_shape_over_dp`` one [b, s] for all, fitting the
    longest sample of any rank (and then as many micro-batches as that b needs for the most samples)."""
    count = int(table[:, 2].max())
    if not _same_shape_over_dp(model[0].config):
        return count, 0
    length = int(table[:, 4].max())
    rows, _ = uniform_shape(length, max_tokens=kwargs["max_tokens"], micro_batch_size=kwargs["micro_batch_size"],
                            multiple=kwargs["multiple"])
    return max(count, -(-int(table[:, 3].max()) // rows)), length


def batch_counts(model, batches: list[list[Sample]], settings: StepSettings) -> list[torch.Tensor]:
    """Each mini-batch's count table, [DP, 5] float64 (``_local_counts`` of every DP rank's share),
    from one all-gather over DP for all of them: the loop gathers a step's tables up front (an
    update then needs no exchange before its schedule; one per update was a visible share of an
    update at DP=2 on the CPU demo) and hands each update its own (``train_step(counts_table=)``)."""
    if not batches:
        return []
    dp_group, _ = _groups()
    local = torch.stack([_local_counts(model, b, settings) for b in batches]).to(compute_device())
    table = all_gather_rows(local.reshape(-1), dp_group).view(-1, len(batches), local.shape[1]).cpu()
    return [table[:, k] for k in range(len(batches))]


def _micro_batches(model, samples: list[Sample], settings: StepSettings,
                   table: torch.Tensor | None = None) -> tuple[list[MicroBatch], torch.Tensor]:
    """This rank's micro-batches, as many on every DP rank, and the mini-batch's global
    (valid tokens, valid sequences), from the mini-batch's count table (``batch_counts``; gathered
    here when not given)."""
    kwargs = _batching(model, settings)
    if table is None:
        table = batch_counts(model, [samples], settings)[0]
    num_mbs, length = _dp_agreement(model, table, kwargs)
    mbs = make_micro_batches(samples, min_count=num_mbs, uniform_length=length, **kwargs)
    return mbs, table[:, :2].sum(0).float().to(compute_device())


def _has_tokens(mb: MicroBatch) -> bool:
    """Whether a micro-batch holds a sample (not only the padding that evens out the DP ranks' counts)."""
    return any(i >= 0 for i in mb.sample_index)


def _forward_step(settings: StepSettings, counts, scale: float, mismatch: bool, data_iterator, model):
    mb = next(data_iterator)
    device = compute_device()
    processor = logprobs_output_processor(mb.labels.to(device), temperature=settings.temperature,
                                          valid_vocab_size=settings.valid_vocab_size,
                                          chunk_tokens=settings.chunk_tokens,
                                          grad_hint=_loss_grad_hint(settings, counts, mb, device))
    # Last stage: (log_probs, entropy), each [b, s] fp32; other stages: hidden states. An MoE router
    # keeps padding out of its load-balancing loss.
    moe = {"padding_mask": stage_padding_mask(model, padding_mask(mb)).to(device)} if model.config.num_moe_experts \
        else {}
    if model.config.moe_enable_routing_replay:  # R3: the engine's experts for this micro-batch's tokens
        replay(model, mb.routed_experts, tuple(mb.input_ids.shape), has_samples=_has_tokens(mb))
    with without_router_losses(model.config, off=bool(moe) and not _has_tokens(mb)):
        output = model(mb.input_ids.to(device), mb.position_ids.to(device), None, output_processor=processor, **moe)
    if moe and isinstance(output, tuple):  # the last stage's (log_probs, entropy)
        output = TokenOutputs(*output)
    return output, functools.partial(_loss_func, settings, counts, scale, mismatch, mb)


# Policy losses whose token's term depends on that token's log-prob alone (a chunk's gradient hint
# holds); GSPO's sequence ratio reads the whole response.
PER_TOKEN_LOSSES = ("dapo", "cispo")


def _loss_grad_hint(settings: StepSettings, counts, mb: MicroBatch, device) -> GradHint | None:
    """d loss / d log p of some positions of the micro-batch from their log-probs alone, for the
    output layer to compute its gradients in the forward (logprobs.py, ``GradHint``); positions
    outside the loss mask have none. Exact up to the schedule's scaling for token-mean, a sum of
    per-token terms over the global token count; the seq-mean modes divide by per-sequence counts
    a chunk does not see, and GSPO's ratio is a mean over the whole response: None (recompute)."""
    if (settings.loss_agg_mode != "token-mean" or settings.policy_loss not in PER_TOKEN_LOSSES or counts is None
            or not torch.is_grad_enabled()):
        return None
    loss_fn = settings.policy_loss_fn()
    per_token = {"old": mb.old_log_probs, "adv": mb.advantages, "mask": mb.loss_mask}
    if mb.is_weights is not None:
        per_token["weights"] = mb.is_weights
    flat = {k: v.to(device).reshape(-1) for k, v in per_token.items()}

    def grad(index, log_probs):
        weights = {"is_weights": flat["weights"][index][None]} if "weights" in flat else {}
        with torch.enable_grad():  # called inside an autograd Function's forward
            lp = log_probs.detach()[None].requires_grad_()
            loss, _ = loss_fn(lp, flat["old"][index][None], flat["adv"][index][None],
                              flat["mask"][index][None], global_num_tokens=counts[0],
                              global_num_seqs=counts[1], **weights)
            return torch.autograd.grad(loss, lp, allow_unused=True, materialize_grads=True)[0][0]

    return GradHint(grad=grad, active=mb.loss_mask.cpu() != 0)


def _loss_func(settings: StepSettings, counts, scale: float, mismatch: bool, mb: MicroBatch, output,
               non_loss_data=False):
    log_probs, entropy = output
    if non_loss_data:  # forward-only log-prob pass: collected per micro-batch, [2, b, s]
        return torch.stack([log_probs.detach(), entropy.detach()])
    device = log_probs.device
    mask = mb.loss_mask.to(device)
    weights = {} if mb.is_weights is None else {"is_weights": mb.is_weights.to(device)}
    loss, metrics = settings.policy_loss_fn()(
        log_probs, mb.old_log_probs.to(device), mb.advantages.to(device), mask,
        global_num_tokens=counts[0], global_num_seqs=counts[1], **weights)
    metrics["actor/entropy"] = (entropy.detach() * mask).sum() / counts[0].clamp(min=1.0)
    if mismatch:
        metrics.update(_mismatch_sums(mb, log_probs.detach()))
    # x (M x DP): undoes the schedule's 1 / M and DDP's 1 / DP (module docstring). A new tensor,
    # so the schedule's in-place division does not reach the metrics.
    return loss * scale, metrics


def _run_schedule(model, mbs: list[MicroBatch], settings: StepSettings, counts, *, forward_only: bool,
                  collect_non_loss_data: bool = False, mismatch: bool = False) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = float(len(mbs) * ps.get_data_parallel_world_size())
    iters = [iter(mbs) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, settings, counts, scale, mismatch),
        data_iterator=iters if len(model) > 1 else iters[0],
        model=model,
        num_microbatches=len(mbs),
        # The p2p shape without variable_seq_lengths (uniform micro-batches); ignored with it.
        seq_length=max(mb.input_ids.shape[1] for mb in mbs),
        micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


# The engine/trainer mismatch measured in an update's forward (train.old_log_probs=rollout: no
# old-log-prob pass computes the trainer's side): per-micro-batch partial sums over response tokens,
# reduced with the loss's metrics and turned into weight_sync.logprob_mismatch's three figures.
MISMATCH_SUMS = ("rollout/_mismatch_expm1_sum", "rollout/_mismatch_abs_sum", "rollout/_mismatch_tokens")
MISMATCH_MAX = ("rollout/logprob_abs_diff_max",)


def _mismatch_sums(mb: MicroBatch, log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
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


def _local_metrics(per_mb: list[dict], settings: StepSettings, shortcut: ShortcutStats,
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
    dp_group, pp_group = _groups()
    table = all_gather_rows(torch.cat([p.local for p in pending]), dp_group)  # [DP, sum of sizes]
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
        dist.broadcast(flat, src=_pp_last_rank(), group=pp_group)
    out = []
    for p, reduced in zip(pending, torch.split(flat, [p.local.numel() for p in pending])):
        metrics = dict(zip(p.sum_keys + p.max_keys, reduced))
        if p.mismatch:
            _finish_mismatch(metrics)
        metrics.update(p.known)
        values = torch.stack([v.detach().float().cpu() for v in metrics.values()]).tolist()
        out.append(dict(zip(metrics, values)))
    return out


def train_step(model: list, optimizer, scheduler, samples: list[Sample], settings: StepSettings, *,
               forward_only: bool = False, mismatch: bool = False,
               defer_metrics: bool = False,
               counts_table: torch.Tensor | None = None) -> dict[str, float] | PendingMetrics:
    """One optimizer update on this DP rank's ``samples`` (every TP / PP rank of a model replica
    passes the same list; DP ranks pass disjoint parts of the mini-batch, of any sizes).

    ``forward_only``: the loss and metrics without an update (no gradients, no optimizer step).
    Returns the mini-batch's metrics, identical on every rank: the loss's metrics (global
    token-means), ``actor/entropy``, ``actor/num_tokens``, ``actor/num_seqs`` (valid ones, whole
    mini-batch), ``actor/num_micro_batches`` (per DP rank, padded to a common count) and, for an
    update, ``actor/grad_norm`` (before clipping) and ``actor/lr`` (the lr this update used), and
    ``actor/grad_shortcut_used`` / ``actor/grad_shortcut_fallbacks``: how many micro-batches'
    output-layer backward took the gradients the forward computed from the loss's hint, and how
    many had to recompute them because the gradient that arrived was not the hint's (per DP rank,
    the mean over them, like actor/num_micro_batches; both 0 without a hint: seq-mean modes,
    forward_only). Fallbacks cost time, not correctness; above 0 they mean the hint no longer
    matches the loss. The loop (train.py ``_accumulate``) averages them over a step's updates,
    so a step's record holds the mean count per update.

    ``mismatch``: also weight_sync.logprob_mismatch's three figures (rollout/logprob_mismatch,
    rollout/logprob_abs_diff_mean, rollout/logprob_abs_diff_max) of the samples' rollout log-probs
    against this forward's, over the mini-batch's response tokens: the engine/trainer mismatch at
    the generating weights when this is the step's first update.

    ``defer_metrics``: return the update's ``PendingMetrics`` instead; ``reduce_metrics`` of a list
    of them gives each one's dict above (every rank must defer, and reduce, the same updates).
    ``counts_table``: this mini-batch's entry of ``batch_counts`` (gathered here when None).
    """
    if model[0].config.context_parallel_size > 1:
        raise NotImplementedError("context parallelism needs per-rank sequence slicing, not implemented yet")
    mbs, counts = _micro_batches(model, samples, settings, counts_table)
    before = SHORTCUT_STATS.snapshot()
    AGREEMENT.take()  # this update's replays only (a log-prob pass replays too)
    if forward_only:
        with torch.no_grad():
            per_mb = _run_schedule(model, mbs, settings, counts, forward_only=True, mismatch=mismatch)
    else:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        per_mb = _run_schedule(model, mbs, settings, counts, forward_only=False, mismatch=mismatch)
    pending = _local_metrics(per_mb, settings, SHORTCUT_STATS.since(before), mismatch)
    metrics = pending.known
    if model[0].config.num_moe_experts:  # the router's own losses (none in a forward-only pass), R3's agreement
        clear_replay(model)
        metrics.update(moe_metrics(model[0].config, sum(map(_has_tokens, mbs)), compute_device()))
    metrics["actor/num_tokens"], metrics["actor/num_seqs"] = counts[0], counts[1]
    metrics["actor/num_micro_batches"] = torch.tensor(float(len(mbs)))
    if not forward_only:
        scheduler.step(increment=1)  # before the update: update k uses warmup fraction k / W
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (inf / nan gradients); bf16 and fp32 do not overflow, "
                               "so the loss or the data is broken")
        if grad_norm is None:  # clip_grad = 0 computes no norm
            grad_norm = optimizer.get_grad_norm()
        metrics["actor/grad_norm"] = torch.as_tensor(grad_norm, dtype=torch.float32)
        metrics["actor/lr"] = torch.tensor(current_lr(optimizer))
    return pending if defer_metrics else reduce_metrics([pending])[0]


def compute_log_probs(model: list, samples: list[Sample], settings: StepSettings) -> tuple[list, list]:
    """Forward-only log-probs and entropies of each sample's response tokens at the rollout
    temperature: ([R] fp32 per sample, [R] fp32 per sample), on every rank of the replica.
    ``old_log_probs`` / advantages of the samples are not read."""
    from megatron.core import parallel_state as ps

    kwargs = _batching(model, settings)
    if model[0].config.expert_model_parallel_size > 1:  # the DP ranks run as many micro-batches (of one shape)
        num_mbs, length = _dp_agreement(model, batch_counts(model, [samples], settings)[0], kwargs)
        kwargs.update(min_count=num_mbs, uniform_length=length)
    mbs = make_micro_batches(samples, **kwargs)
    with torch.no_grad():
        collected = _run_schedule(model, mbs, settings, None, forward_only=True, collect_non_loss_data=True)
    clear_replay(model)
    lengths = [x.num_response_tokens for x in samples]
    flat = torch.empty(2, sum(lengths), dtype=torch.float32, device=compute_device())
    if collected:  # the last stage: [2, b, s] per micro-batch -> [2, sum R]
        lp = unpack_responses([c[0] for c in collected], mbs, len(samples))
        ent = unpack_responses([c[1] for c in collected], mbs, len(samples))
        flat = torch.stack([torch.cat(lp), torch.cat(ent)]) if samples else flat
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(flat, src=_pp_last_rank(), group=pp_group)
    flat = flat.cpu()
    return list(torch.split(flat[0], lengths)), list(torch.split(flat[1], lengths))
