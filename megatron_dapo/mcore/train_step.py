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
Each micro-batch loss L_mb (this DP rank's share of the global token-mean) is returned as
L_mb x M x DP / CP; step 1 makes it L_mb x DP. At CP = 1, step 2 then gives the sum over DP ranks
and micro-batches of d L_mb / d theta: exactly d(global token-mean) / d theta. Under context
parallelism every CP rank computes the same whole L_mb from log-probs gathered over CP
(mcore/context_parallel.py); the gather's backward all-reduces the CP ranks' identical gradients
(x CP) and keeps each rank's own positions, so a rank's gradient is CP x DP x (L_mb's gradient
through its positions), and step 2's 1 / (DP x CP) and sum over DP x CP leave the sum over all
positions once: the same d(global token-mean) / d theta. (Megatron's own per-token path, a
3-tuple with calculate_per_token_loss=True, divides by a token count that finalize_model_grads
sums over DP; the pre-divided loss here also covers the seq-mean modes.)

The output layer. For token-mean (a sum of per-token terms over the global count) the forward
hands logprobs.py a hint, ``_loss_grad_hint``: the loss's gradient at a chunk's log-probs, from
those log-probs alone. The fused output layer then computes its input and weight gradients while
each chunk's logits exist instead of recomputing them in backward, a quarter less output-layer
work, and skips positions outside the loss mask; backward checks that the gradient that arrived
is the hint times one scalar (the scaling above) and recomputes otherwise.

Packed micro-batches (train.pack_sequences, batching.py): the model gets megatron's PackedSeqParams
(THD) with the samples' boundaries, and the loss one row per sample gathered from the packed
positions (``_sequence_rows``), so that every aggregation mode sees sequences; the gradient hint works
on the packed positions as on padded ones.

Around the schedule: the micro-batches every DP rank agrees on and the global token counts
(micro_batches.py, gathered for a whole step in one exchange: ``batch_counts``), and the metrics
summed over micro-batches and exchanged once per step (step_metrics.py: ``defer_metrics``,
``reduce_metrics``). One host sync per step for the metrics, and one per micro-batch in the output
layer's backward (the hint check).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_dapo.batching import MicroBatch, Sample, padding_mask, unpack_responses
from megatron_dapo.mcore.context_parallel import gather_sequence, slice_for_rank
from megatron_dapo.mcore.logprobs import SHORTCUT_STATS, GradHint, logprobs_output_processor
from megatron_dapo.mcore.micro_batches import has_tokens, log_prob_micro_batches, update_micro_batches
from megatron_dapo.mcore.moe import (
    AGREEMENT, TokenOutputs, clear_replay, filler_index, moe_metrics, replay, stage_padding_mask, without_router_losses,
)
from megatron_dapo.mcore.optimizer import current_lr
from megatron_dapo.mcore.step_metrics import PendingMetrics, local_metrics, mismatch_sums, reduce_metrics
from megatron_dapo.mcore.step_settings import StepSettings, compute_device


def _forward_step(settings: StepSettings, counts, scale: float, mismatch: bool, data_iterator, model):
    mb = next(data_iterator)
    device = compute_device()
    cp_group = _cp_group(model.config)
    bounds = tuple(mb.cu_seqlens().tolist()) if mb.packed else None  # a packed row's segments
    local = functools.partial(_on_this_cp_rank, cp_group, bounds)  # the positions this CP rank holds (all at CP 1)
    processor = logprobs_output_processor(local(mb.labels).to(device), temperature=settings.temperature,
                                          valid_vocab_size=settings.valid_vocab_size,
                                          chunk_tokens=settings.chunk_tokens,
                                          grad_hint=_loss_grad_hint(settings, counts, mb, device, local))
    # Last stage: (log_probs, entropy), each [b, s] fp32; other stages: hidden states. An MoE router
    # keeps padding out of its load-balancing loss; under CP it routes this rank's positions, and
    # megatron sums its token counts over TP x CP.
    moe = {"padding_mask": stage_padding_mask(model, local(padding_mask(mb))).to(device)} \
        if model.config.num_moe_experts else {}
    input_ids = local(mb.input_ids)
    if model.config.moe_enable_routing_replay:  # R3: the engine's experts for this rank's tokens
        routes = None if mb.routed_experts is None else local(mb.routed_experts)
        replay(model, routes, tuple(input_ids.shape), has_samples=has_tokens(mb),
               token_index=local(filler_index(*mb.input_ids.shape)))
    packed = {"packed_seq_params": packed_seq_params(mb, device)} if mb.packed else {}
    with without_router_losses(model.config, off=bool(moe) and not has_tokens(mb)):
        output = model(input_ids.to(device), local(mb.position_ids).to(device), None,
                       output_processor=processor, **moe, **packed)
    if moe and isinstance(output, tuple):  # the last stage's (log_probs, entropy)
        output = TokenOutputs(*output)
    return output, functools.partial(_loss_func, settings, counts, scale, mismatch, mb, cp_group, bounds)


def _cp_group(config):
    """The context-parallel group when CP > 1, else None."""
    if config.context_parallel_size == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _on_this_cp_rank(group, bounds, values: torch.Tensor) -> torch.Tensor:
    """[b, s] -> the [b, s / CP] positions this CP rank holds (context_parallel.py; ``bounds``: a
    packed row's segments, each cut on its own); as is at CP 1."""
    if group is None:
        return values
    return slice_for_rank(values, dist.get_world_size(group), dist.get_rank(group), bounds=bounds)


# Policy losses whose token's term depends on that token's log-prob alone (a chunk's gradient hint
# holds); GSPO's sequence ratio reads the whole response.
PER_TOKEN_LOSSES = ("dapo", "cispo")


def _loss_grad_hint(settings: StepSettings, counts, mb: MicroBatch, device, local) -> GradHint | None:
    """d loss / d log p of some positions of the micro-batch from their log-probs alone, for the
    output layer to compute its gradients in the forward (logprobs.py, ``GradHint``); positions
    outside the loss mask have none. Exact up to the schedule's scaling for token-mean, a sum of
    per-token terms over the global token count; the seq-mean modes divide by per-sequence counts
    a chunk does not see, and GSPO's ratio is a mean over the whole response: None (recompute).
    ``local``: [b, s] -> the positions the output layer sees (this CP rank's; all at CP 1): a
    token's term is its own wherever it sits, and the gather over CP scales every position's
    gradient alike, so the hint holds under CP too."""
    if (settings.loss_agg_mode != "token-mean" or settings.policy_loss not in PER_TOKEN_LOSSES or counts is None
            or not torch.is_grad_enabled()):
        return None
    loss_fn = settings.policy_loss_fn()
    per_token = {"old": mb.old_log_probs, "adv": mb.advantages, "mask": mb.loss_mask}
    if mb.is_weights is not None:
        per_token["weights"] = mb.is_weights
    flat = {k: local(v).to(device).reshape(-1) for k, v in per_token.items()}

    def grad(index, log_probs):
        weights = {"is_weights": flat["weights"][index][None]} if "weights" in flat else {}
        with torch.enable_grad():  # called inside an autograd Function's forward
            lp = log_probs.detach()[None].requires_grad_()
            loss, _ = loss_fn(lp, flat["old"][index][None], flat["adv"][index][None],
                              flat["mask"][index][None], global_num_tokens=counts[0],
                              global_num_seqs=counts[1], **weights)
            return torch.autograd.grad(loss, lp, allow_unused=True, materialize_grads=True)[0][0]

    return GradHint(grad=grad, active=local(mb.loss_mask).cpu() != 0)


def _loss_func(settings: StepSettings, counts, scale: float, mismatch: bool, mb: MicroBatch, cp_group, bounds,
               output, non_loss_data=False):
    log_probs, entropy = output
    if cp_group is not None:  # each CP rank's positions -> whole rows, on every CP rank (one gather)
        log_probs, entropy = gather_sequence(torch.stack([log_probs, entropy.detach()]), cp_group, dim=2,
                                             bounds=bounds).unbind()
    if non_loss_data:  # forward-only log-prob pass: collected per micro-batch, [2, b, s]
        return torch.stack([log_probs.detach(), entropy.detach()])
    device = log_probs.device
    rows = _sequence_rows(mb, device)
    mask = rows(mb.loss_mask.to(device))
    weights = {} if mb.is_weights is None else {"is_weights": rows(mb.is_weights.to(device))}
    loss, metrics = settings.policy_loss_fn()(
        rows(log_probs), rows(mb.old_log_probs.to(device)), rows(mb.advantages.to(device)), mask,
        global_num_tokens=counts[0], global_num_seqs=counts[1], **weights)
    metrics["actor/entropy"] = (rows(entropy.detach()) * mask).sum() / counts[0].clamp(min=1.0)
    if mismatch:
        metrics.update(mismatch_sums(mb, log_probs.detach()))
    # x (M x DP / CP): undoes the schedule's 1 / M and DDP's 1 / DP; every CP rank computes this same
    # whole loss (module docstring). A new tensor, so the schedule's in-place scaling does not reach
    # the metrics.
    return loss * scale, metrics


def _sequence_rows(mb: MicroBatch, device):
    """[b, s] per-position values -> the loss's layout, one row per sequence: the padded layout as it
    is; a packed one gathered to [samples, longest R] (response positions; 0 past each length, where
    the mask is 0 too), so that the per-sequence modes (seq-mean, GSPO's ratio) see sequences."""
    if not mb.packed:
        return lambda values: values
    index = mb.response_index().to(device)
    valid = index >= 0
    flat_index = index.clamp(min=0)
    return lambda values: torch.where(valid, values.reshape(-1)[flat_index], torch.zeros((), dtype=values.dtype,
                                                                                        device=device))


def packed_seq_params(mb: MicroBatch, device):
    """megatron's PackedSeqParams (THD) of a packed micro-batch: its samples' boundaries for the
    attention (sdpa_attention.py on the local spec, Transformer Engine's on the TE spec) and RoPE,
    whose positions restart at each boundary."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens()
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _run_schedule(model, mbs: list[MicroBatch], settings: StepSettings, counts, *, forward_only: bool,
                  collect_non_loss_data: bool = False, mismatch: bool = False) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = len(mbs) * ps.get_data_parallel_world_size() / ps.get_context_parallel_world_size()
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
    mbs, counts = update_micro_batches(model, samples, settings, counts_table)
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
    pending = local_metrics(per_mb, settings, SHORTCUT_STATS.since(before), mismatch)
    metrics = pending.known
    if model[0].config.num_moe_experts:  # the router's own losses (none in a forward-only pass), R3's agreement
        clear_replay(model)
        metrics.update(moe_metrics(model[0].config, sum(map(has_tokens, mbs)), len(mbs), compute_device()))
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

    mbs = log_prob_micro_batches(model, samples, settings)
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
        dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    flat = flat.cpu()
    return list(torch.split(flat[0], lengths)), list(torch.split(flat[1], lengths))
