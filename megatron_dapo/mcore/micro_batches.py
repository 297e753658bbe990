"""A mini-batch's micro-batches, agreed over data parallelism.

Every DP rank runs as many micro-batches (the schedule's collectives pair them up), and under
expert parallelism with megatron's allgather dispatcher every micro-batch has one [b, s] on every
rank (each MoE layer gathers the EP ranks' tokens). Each rank states what its share needs, a row of
five counts (``_local_counts``); one all-gather over DP gives every rank the table, and the table
gives the agreement (``_dp_agreement``) and the loss's global token and sequence counts. The loop
gathers a step's tables up front, one exchange for all its updates (``batch_counts``).
"""

from __future__ import annotations

import torch

from megatron_dapo.batching import MicroBatch, Sample, count_micro_batches, make_micro_batches, uniform_shape
from megatron_dapo.mcore.parallel import all_gather_rows
from megatron_dapo.mcore.step_settings import StepSettings, compute_device
from megatron_dapo.micro_batch_shapes import allgather_moe_of, one_shape_of


def batching_kwargs(model, settings: StepSettings) -> dict:
    """batching.make_micro_batches' limits for this model's layout (token budget, rows, padding
    multiple, the count's multiple, whether every micro-batch must have one shape)."""
    config = model[0].config
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    return dict(max_tokens=settings.max_tokens_per_micro_batch, micro_batch_size=settings.micro_batch_size,
                multiple=settings.pad_multiple,
                count_multiple=pp if vpp else 1,  # the interleaved schedule needs M % PP == 0
                # stages that cannot exchange shapes, or EP ranks gathering each other's tokens
                uniform=one_shape_of(config),
                packed=settings.pack_sequences,
                # context parallelism cuts each packed sample's slot into 2 x CP chunks of its own
                segment_multiple=2 * config.context_parallel_size
                if settings.pack_sequences and config.context_parallel_size > 1 else 1)


def same_shape_over_dp(config) -> bool:
    """Whether every data-parallel rank must run micro-batches of one [b, s]: megatron's allgather token
    dispatcher gathers the hidden states of the EP ranks (taken from the DP ranks) in every MoE
    layer, which needs as many tokens on each. Under expert parallelism the DP ranks also run as many
    micro-batches (each MoE layer's forward is a collective), which ``update_micro_batches`` and
    ``log_prob_micro_batches`` agree on."""
    return config.expert_model_parallel_size > 1 and allgather_moe_of(config)


def _local_counts(model, samples: list[Sample], settings: StepSettings) -> torch.Tensor:
    """[5] float64: this DP rank's (valid tokens, valid sequences, micro-batches, samples, longest sample's
    tokens) for ``samples``, from the samples (their loss masks: rollout correction's rejections
    included) and the micro-batch plan."""
    valid = [float(x.loss_mask.sum()) if x.loss_mask is not None else float(x.num_response_tokens)
             for x in samples]
    return torch.tensor([sum(valid), sum(1.0 for v in valid if v > 0),
                         float(count_micro_batches(samples, **batching_kwargs(model, settings))), float(len(samples)),
                         float(max((x.num_tokens for x in samples), default=0))], dtype=torch.float64)


def _dp_agreement(model, table: torch.Tensor, kwargs: dict) -> tuple[int, int]:
    """(micro-batches, uniform length) every DP rank uses, from the ranks' ``_local_counts`` rows ``table``:
    the most micro-batches any rank needs; under ``same_shape_over_dp`` one [b, s] for all, fitting the
    longest sample of any rank (and then as many micro-batches as that b needs for the most samples)."""
    count = int(table[:, 2].max())
    if not same_shape_over_dp(model[0].config):
        return count, 0
    length = int(table[:, 4].max())
    if kwargs["packed"]:  # [1, the budget]: each rank's own plan already packs into that shape
        return count, length
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
    from megatron.core import parallel_state as ps

    local = torch.stack([_local_counts(model, b, settings) for b in batches]).to(compute_device())
    table = all_gather_rows(local.reshape(-1), ps.get_data_parallel_group())
    table = table.view(-1, len(batches), local.shape[1]).cpu()
    return [table[:, k] for k in range(len(batches))]


def update_micro_batches(model, samples: list[Sample], settings: StepSettings,
                   table: torch.Tensor | None = None) -> tuple[list[MicroBatch], torch.Tensor]:
    """This rank's micro-batches, as many on every DP rank, and the mini-batch's global
    (valid tokens, valid sequences), from the mini-batch's count table (``batch_counts``; gathered
    here when not given)."""
    kwargs = batching_kwargs(model, settings)
    if table is None:
        table = batch_counts(model, [samples], settings)[0]
    num_mbs, length = _dp_agreement(model, table, kwargs)
    mbs = make_micro_batches(samples, min_count=num_mbs, uniform_length=length, **kwargs)
    return mbs, table[:, :2].sum(0).float().to(compute_device())


def has_tokens(mb: MicroBatch) -> bool:
    """Whether a micro-batch holds a sample (not only the padding that evens out the DP ranks' counts)."""
    return any(i >= 0 for i in mb.sample_index)


def log_prob_micro_batches(model, samples: list[Sample], settings: StepSettings) -> list[MicroBatch]:
    """The forward-only log-prob pass's micro-batches: this rank's own plan, except under expert
    parallelism, where the DP ranks run as many (of one shape) as an update would."""
    kwargs = batching_kwargs(model, settings)
    if model[0].config.expert_model_parallel_size > 1:
        num_mbs, length = _dp_agreement(model, batch_counts(model, [samples], settings)[0], kwargs)
        kwargs.update(min_count=num_mbs, uniform_length=length)
    return make_micro_batches(samples, **kwargs)
