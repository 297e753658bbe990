"""Rollout samples -> padded micro-batches: token-budget packing, label / mask alignment, DP balance.

A ``Sample`` is one prompt + response. A micro-batch holds whole samples, right-padded to one
length ``s`` (a multiple of ``pad_multiple``: TP under sequence parallelism, 2 x CP under context
parallelism, TP x CP under both). In a micro-batch of ``b`` rows, for the sample in row i with P prompt and R response
tokens (L = P + R):

    input_ids[i, t]     token t, t < L; 0 beyond
    position_ids[i, t]  t
    labels[i, t]        input_ids[i, t + 1]: the token that position t predicts (0 where none)
    loss_mask[i, t]     1 where labels[i, t] is a response token that counts: t in [P - 1, L - 2]
    old_log_probs, rollout_log_probs, advantages, is_weights: per response token, at the same
        positions as their labels (0 where a sample has none; is_weights 1)

No attention mask is built: with right padding, the causal mask already keeps every real token
from seeing the padding after it, and padded positions are masked out of the loss.

Packed (``packed=True``, THD): a micro-batch is one row of samples laid end to end, [1, T], T the
sum of their lengths rounded up to ``pad_multiple`` (the padding a segment of its own at the end).
Entry k starts at ``starts[k]``; every per-position tensor above holds the same values at the same
offsets within the sample, positions restart at 0 per sample, a sample's last token has label 0
(the next sample is not its continuation), and ``cu_seqlens`` gives the attention its boundaries:
no token attends across one. Nothing is spent on padding rows: a budget of T tokens holds T
tokens of samples, where padded rows hold rows x the longest. Under context parallelism each
sample's slot is its length rounded up to 2 x CP (``segment_multiple``), its padding inside its own
segment, so that every segment cuts into 2 x CP equal chunks (mcore/context_parallel.py).

Sizing (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``): with a token budget, samples
are packed first-fit-decreasing into micro-batches of at most ``max_tokens`` padded tokens
(rows x padded length); with a budget of 0, consecutive groups of ``micro_batch_size`` samples.
Both are deterministic functions of the sample lengths. A pipeline whose stages cannot exchange
shapes needs ``uniform`` micro-batches (all [b, s] alike). Megatron's schedules take one
``num_microbatches`` per call; ranks that should agree on it (the DP ranks of a step) pad with
empty micro-batches: one row of ``pad_multiple`` padding tokens, loss mask 0.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sample:
    """One rollout. ``advantages``: a float or 0-d tensor (per sequence) or [R] (per token);
    ``old_log_probs``: [R] log pi_old of the response tokens (None for a forward-only pass);
    ``loss_mask``: [R], None = every response token counts (0 e.g. for overlong filtering);
    ``rollout_log_probs``: [R] log pi_rollout as the rollout engine reported them (None when it
    reported none; rollout correction needs them); ``is_weights``: [R] rollout correction's
    importance weights, detached, multiplying each token's loss (None: 1); ``routed_experts``: an MoE
    model's routes in the engine, [P + R - 1, layers x top-k] int (the experts each layer sent each
    token to; the last token was never fed to the engine), for moe.router_replay=R3."""

    prompt_ids: Tensor  # [P] int, P >= 1
    response_ids: Tensor  # [R] int
    advantages: Tensor | float = 0.0
    old_log_probs: Tensor | None = None
    loss_mask: Tensor | None = None
    rollout_log_probs: Tensor | None = None
    is_weights: Tensor | None = None
    routed_experts: Tensor | None = None

    def __post_init__(self):
        if self.prompt_ids.dim() != 1 or self.response_ids.dim() != 1 or self.prompt_ids.numel() < 1:
            raise ValueError(f"need prompt_ids [P >= 1] and response_ids [R]; got shapes "
                             f"{tuple(self.prompt_ids.shape)}, {tuple(self.response_ids.shape)}")
        r = self.response_ids.numel()
        for name in ("old_log_probs", "loss_mask", "rollout_log_probs", "is_weights"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (r,):
                raise ValueError(f"{name} must have shape [R] = ({r},), got {tuple(value.shape)}")
        routes = self.routed_experts
        if routes is not None and (routes.dim() != 2 or routes.shape[0] != self.num_tokens - 1):
            raise ValueError(f"routed_experts must have shape [P + R - 1, layers x k] = ({self.num_tokens - 1}, ...), "
                             f"got {tuple(routes.shape)}")
        adv = self.advantages
        if isinstance(adv, (int, float)):  # the common case, checked without making a tensor
            return
        adv = torch.as_tensor(adv)
        if adv.dim() > 1 or (adv.dim() == 1 and adv.numel() != r):
            raise ValueError(f"advantages must be a scalar or [R] = ({r},), got {tuple(adv.shape)}")

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_ids.numel()

    @property
    def num_response_tokens(self) -> int:
        return self.response_ids.numel()

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_response_tokens


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors, all [b, s] (see the module docstring). Per entry (a row of the padded layout;
    a sample of the packed one): ``sample_index``, its sample's position in the list it was built
    from (-1 for a padding row), and its prompt and response lengths; ``starts``: packed, each
    entry's first position in the one row; () in the padded layout (entry i is row i from 0)."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Tensor  # fp32
    old_log_probs: Tensor  # fp32
    rollout_log_probs: Tensor  # fp32
    advantages: Tensor  # fp32
    is_weights: Tensor | None  # fp32; None: no sample of the micro-batch has weights
    # [b, s, layers x k] long, the samples' routed_experts; -1 where there is none (each row's last
    # token, padding); None: no sample has routes
    routed_experts: Tensor | None
    sample_index: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    packed: bool = False
    starts: tuple[int, ...] = ()
    segment_multiple: int = 1  # packed: each sample's slot rounded up to this (2 x CP under context parallelism)

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.numel()

    def entry_offsets(self) -> list[int]:
        """Each entry's first position in the flattened [b * s] tensors."""
        if self.packed:
            return list(self.starts)
        return [row * self.input_ids.shape[1] for row in range(len(self.sample_index))]

    def cu_seqlens(self) -> Tensor:
        """Packed: [segments + 1] int32, the boundaries attention must not cross: each sample's slot
        (its tokens, then its padding to ``segment_multiple``), then the padding's at the end (a
        segment of its own) when there is some."""
        total = self.input_ids.shape[1]
        ends = [start + _round_up(p + r, self.segment_multiple)
                for start, p, r in zip(self.starts, self.prompt_lengths, self.response_lengths)]
        bounds = [0] + ends + ([total] if not ends or ends[-1] < total else [])
        return torch.tensor(bounds, dtype=torch.int32)

    def response_index(self) -> Tensor:
        """[entries, longest R] long: the flattened position of each entry's response-token labels,
        -1 past its length (at least one row and one column): the loss's per-sequence rows."""
        offsets = torch.tensor(self.entry_offsets(), dtype=torch.long).reshape(-1)
        prompt = torch.tensor(self.prompt_lengths, dtype=torch.long).reshape(-1)
        resp = torch.tensor(self.response_lengths, dtype=torch.long).reshape(-1)
        width = max(int(resp.max()) if resp.numel() else 0, 1)
        col = torch.arange(width)
        index = (offsets + prompt - 1)[:, None] + col
        index = torch.where(col < resp[:, None], index, -1)
        return index if index.shape[0] else torch.full((1, width), -1, dtype=torch.long)


FP8_ALIGN = 16
"""Transformer Engine's FP8 GEMMs need the token rows of each GEMM (the product of all dimensions
but the last) divisible by 8 and megatron-core aligns them to 16 (fp8_utils.get_fp8_align_size; 32
only for MXFP8, which is not offered here). Hidden and FFN sizes are the other GEMM dimension and
are multiples of 16 in every Qwen2.5 and Qwen3 shape."""


def pad_multiple(*, tensor_parallel: int = 1, sequence_parallel: bool = False, context_parallel: int = 1,
                 base: int = 1, fp8: bool = False) -> int:
    """The multiple every padded length must be: context parallelism cuts the sequence into 2 x CP
    load-balanced chunks, and sequence parallelism splits each CP rank's share (s / CP) over the TP
    ranks, so s is a multiple of TP x CP too; ``base`` e.g. for kernels. With ``fp8`` each rank's
    share of the sequence (s / TP under sequence parallelism, / CP) is itself a multiple of
    FP8_ALIGN, so a GEMM's rows (share x rows of the micro-batch) are, whatever the number of rows."""
    shards = (tensor_parallel if sequence_parallel else 1) * context_parallel
    multiple = math.lcm(base, shards)
    if context_parallel > 1:
        multiple = math.lcm(multiple, 2 * context_parallel)
    if fp8:
        multiple = math.lcm(multiple, FP8_ALIGN * shards)
    return multiple


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_micro_batches(lengths: Sequence[int], *, max_tokens: int, micro_batch_size: int,
                       multiple: int = 1) -> list[list[int]]:
    """Group sample indices into micro-batches. ``max_tokens`` > 0: first-fit decreasing by
    length (ties by index), a group costing rows x padded length of its longest sample;
    0: consecutive groups of ``micro_batch_size``. Raises when one sample exceeds the budget."""
    if max_tokens < 0 or micro_batch_size < 1:
        raise ValueError(f"need max_tokens >= 0 and micro_batch_size >= 1, got {max_tokens}, "
                         f"{micro_batch_size}")
    if max_tokens == 0:
        return [list(range(i, min(i + micro_batch_size, len(lengths))))
                for i in range(0, len(lengths), micro_batch_size)]
    groups: list[list[int]] = []
    padded: list[int] = []  # the padded length of each group: that of its first (longest) sample
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = _round_up(lengths[i], multiple)
        if length > max_tokens:
            raise ValueError(f"sample {i} has {lengths[i]} tokens ({length} padded to a multiple of "
                             f"{multiple}), more than the micro-batch budget max_tokens={max_tokens}")
        for g, group in enumerate(groups):
            if (len(group) + 1) * padded[g] <= max_tokens:
                group.append(i)
                break
        else:
            groups.append([i])
            padded.append(length)
    return [sorted(group) for group in groups]


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int], *, multiple: int = 1,
                      shape: tuple[int, int] | None = None, packed: bool = False,
                      segment_multiple: int = 1) -> MicroBatch:
    """``samples[indices]`` as one micro-batch: padded rows, or ``packed`` end to end in one row (the
    module docstring); an empty ``indices`` gives a padding row. ``shape``: pad to exactly (rows,
    length) instead of the smallest that fits. ``segment_multiple`` (packed): each sample's slot is
    its length rounded up to it, its padding after it (context parallelism cuts every slot into
    2 x CP equal chunks)."""
    rows = [samples[i] for i in indices]
    n = len(rows)
    lengths = [x.num_tokens for x in rows]
    slots = [_round_up(n_tokens, segment_multiple) for n_tokens in lengths] if packed else lengths
    if packed:
        b, s = 1, _round_up(max(sum(slots), 1), multiple)
    else:
        b, s = max(n, 1), _round_up(max(lengths, default=1), multiple)
    if shape is not None:
        if shape[0] < b or shape[1] < s:
            raise ValueError(f"{n} samples of {max(lengths, default=0)} tokens at most do not fit the shape {shape}"
                             + (f" packed ({sum(slots)} tokens in their slots)" if packed else ""))
        b, s = shape
    starts = list(itertools.accumulate([0] + slots[:-1])) if packed else []
    # Each entry's first position in the flattened [b * s] tensors; every per-sample piece is
    # written with one scatter per tensor (per-row slicing was most of this function's time on the
    # CPU demo).
    first = torch.tensor(starts if packed else [row * s for row in range(n)], dtype=torch.long)
    ids = torch.zeros(b * s, dtype=torch.long)
    labels = torch.zeros(b * s, dtype=torch.long)
    mask, old, rollout, adv = (torch.zeros(b * s, dtype=torch.float32) for _ in range(4))
    weights = routes = None
    if n:
        prompt_n = torch.tensor([x.num_prompt_tokens for x in rows])
        resp_n = torch.tensor([x.num_response_tokens for x in rows])
        tokens = torch.cat([t for x in rows for t in (x.prompt_ids, x.response_ids)])
        ids[_ranges(first, prompt_n + resp_n)] = tokens.long()
        before_last = _ranges(first, prompt_n + resp_n - 1)  # a label is the next token of the same sample
        labels[before_last] = ids[before_last + 1]
        span = _ranges(first + prompt_n - 1, resp_n)  # positions whose label is a response token
        r = resp_n.tolist()
        mask[span] = _span_values([x.loss_mask for x in rows], resp_n, r, fill=1.0)
        old[span] = _span_values([x.old_log_probs for x in rows], resp_n, r, fill=0.0)
        rollout[span] = _span_values([x.rollout_log_probs for x in rows], resp_n, r, fill=0.0)
        adv[span] = _span_values([x.advantages for x in rows], resp_n, r, fill=0.0)
        if any(x.is_weights is not None for x in rows):
            weights = torch.ones(b * s, dtype=torch.float32)
            weights[span] = _span_values([x.is_weights for x in rows], resp_n, r, fill=1.0)
        if any(x.routed_experts is not None for x in rows):
            if any(x.routed_experts is None for x in rows):
                raise ValueError("a micro-batch mixes samples with and without routed_experts")
            routes = torch.full((b * s, rows[0].routed_experts.shape[1]), -1, dtype=torch.long)
            routes[before_last] = torch.cat([x.routed_experts for x in rows]).long()
    if packed:  # positions restart with each sample, and with the padding at the end
        bounds = torch.tensor(starts + [sum(slots)], dtype=torch.long)
        position_ids = (torch.arange(s) - bounds[torch.searchsorted(bounds, torch.arange(s), right=True) - 1])[None]
    else:
        position_ids = torch.arange(s).expand(b, s).contiguous()
    fill = 0 if packed else b - n  # padding rows
    return MicroBatch(
        input_ids=ids.view(b, s), position_ids=position_ids, labels=labels.view(b, s), loss_mask=mask.view(b, s),
        old_log_probs=old.view(b, s), rollout_log_probs=rollout.view(b, s), advantages=adv.view(b, s),
        is_weights=None if weights is None else weights.view(b, s),
        routed_experts=None if routes is None else routes.view(b, s, -1),
        sample_index=tuple(indices) + (-1,) * fill,
        prompt_lengths=tuple(x.num_prompt_tokens for x in rows) + (0,) * fill,
        response_lengths=tuple(x.num_response_tokens for x in rows) + (0,) * fill,
        packed=packed, starts=tuple(starts), segment_multiple=segment_multiple if packed else 1)


def _ranges(first: Tensor, counts: Tensor) -> Tensor:
    """The concatenation of arange(first[k], first[k] + counts[k]) over k, as one tensor."""
    counts = counts.long()
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    offsets = first.long() - (torch.cumsum(counts, 0) - counts)
    return torch.repeat_interleave(offsets, counts, output_size=total) + torch.arange(total)


def _span_values(values: list, resp_n: Tensor, lengths: list[int], *, fill: float) -> Tensor:
    """[sum R] fp32: per row its [R] tensor, its scalar (float or 0-d) repeated R times, or ``fill``
    for None, concatenated in row order."""
    if all(isinstance(v, Tensor) and v.dim() == 1 for v in values):
        return torch.cat(values).float()
    if not any(isinstance(v, Tensor) and v.dim() == 1 for v in values):
        per_row = torch.tensor([fill if v is None else float(v) for v in values], dtype=torch.float32)
        return per_row.repeat_interleave(resp_n)
    return torch.cat([torch.full((r,), fill) if v is None else torch.as_tensor(v, dtype=torch.float32).expand(r)
                      for v, r in zip(values, lengths)])


def response_mask(mb: MicroBatch) -> Tensor:
    """[b, s] 1.0 at the positions whose label is a response token (build_micro_batch's span), else 0."""
    mask = torch.zeros(mb.input_ids.numel(), dtype=torch.float32)
    first = torch.tensor(mb.entry_offsets(), dtype=torch.long)
    mask[_ranges(first + torch.tensor(mb.prompt_lengths) - 1, torch.tensor(mb.response_lengths))] = 1.0
    return mask.view(mb.input_ids.shape)


def padding_mask(mb: MicroBatch) -> Tensor:
    """[b, s] bool, True at the positions of no sample (padding rows: all; packed: the tail): what
    megatron's MoE router leaves out of its load-balancing statistics (GPTModel's ``padding_mask``)."""
    real = torch.zeros(mb.input_ids.numel(), dtype=torch.bool)
    lengths = torch.tensor([p + r for p, r in zip(mb.prompt_lengths, mb.response_lengths)], dtype=torch.long)
    real[_ranges(torch.tensor(mb.entry_offsets(), dtype=torch.long), lengths)] = True
    return ~real.view(mb.input_ids.shape)


def plan_packs(lengths: Sequence[int], *, max_tokens: int, micro_batch_size: int, multiple: int = 1) -> list[list[int]]:
    """Group sample indices into packs. ``max_tokens`` > 0: first-fit decreasing by length (ties by
    index), a pack costing the sum of its samples' lengths rounded up to ``multiple``; 0: consecutive
    groups of ``micro_batch_size``. Raises when one sample exceeds the budget."""
    if max_tokens < 0 or micro_batch_size < 1:
        raise ValueError(f"need max_tokens >= 0 and micro_batch_size >= 1, got {max_tokens}, {micro_batch_size}")
    if max_tokens == 0:
        return plan_micro_batches(lengths, max_tokens=0, micro_batch_size=micro_batch_size)
    packs: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if _round_up(lengths[i], multiple) > max_tokens:
            raise ValueError(f"sample {i} has {lengths[i]} tokens ({_round_up(lengths[i], multiple)} padded to a "
                             f"multiple of {multiple}), more than the micro-batch budget max_tokens={max_tokens}")
        for k, pack in enumerate(packs):
            if _round_up(used[k] + lengths[i], multiple) <= max_tokens:
                pack.append(i)
                used[k] += lengths[i]
                break
        else:
            packs.append([i])
            used.append(lengths[i])
    return [sorted(pack) for pack in packs]


def make_micro_batches(samples: Sequence[Sample], *, max_tokens: int, micro_batch_size: int,
                       multiple: int = 1, min_count: int = 1, count_multiple: int = 1,
                       uniform: bool = False, uniform_length: int = 0, packed: bool = False,
                       segment_multiple: int = 1) -> list[MicroBatch]:
    """All of ``samples`` as micro-batches (see ``plan_micro_batches``; ``packed``: ``plan_packs``),
    padded with empty ones to at least ``min_count`` and to a multiple of ``count_multiple``
    (interleaved PP needs a multiple of the PP size).

    ``uniform``: every micro-batch gets the same [b, s] (pipelines that cannot exchange shapes):
    s fits the longest sample (and is at least ``uniform_length``: ranks that must agree on one
    shape pass their longest, ``uniform_shape``), b = max_tokens // s rows (or micro_batch_size
    without a budget), consecutive samples per micro-batch. Packed, [1, the budget] (or
    micro_batch_size x the longest without one), packed first-fit decreasing as without, each sample
    costing its slot (``segment_multiple``: build_micro_batch)."""
    plan, shape = _layout(samples, max_tokens=max_tokens, micro_batch_size=micro_batch_size,
                          multiple=multiple, min_count=min_count, count_multiple=count_multiple,
                          uniform=uniform, uniform_length=uniform_length, packed=packed,
                          segment_multiple=segment_multiple)
    return [build_micro_batch(samples, group, multiple=multiple, shape=shape, packed=packed,
                              segment_multiple=segment_multiple) for group in plan]


def count_micro_batches(samples: Sequence[Sample], **kwargs) -> int:
    """How many micro-batches ``make_micro_batches(samples, **kwargs)`` makes, without making them."""
    return len(_layout(samples, **kwargs)[0])


def uniform_shape(longest: int, *, max_tokens: int, micro_batch_size: int, multiple: int = 1,
                  packed: bool = False) -> tuple[int, int]:
    """The [b, s] of uniform micro-batches whose longest sample has ``longest`` tokens (packed: [1,
    the budget rounded down to ``multiple``], or micro_batch_size samples of the longest without one)."""
    s = _round_up(max(longest, 1), multiple)
    if max_tokens and s > max_tokens:
        raise ValueError(f"the longest sample has {longest} tokens ({s} padded), more than the "
                         f"micro-batch budget max_tokens={max_tokens}")
    if packed:
        return (1, max_tokens // multiple * multiple if max_tokens else _round_up(micro_batch_size * longest, multiple))
    return (max_tokens // s if max_tokens else micro_batch_size, s)


def _layout(samples: Sequence[Sample], *, max_tokens: int, micro_batch_size: int, multiple: int = 1,
            min_count: int = 1, count_multiple: int = 1, uniform: bool = False,
            uniform_length: int = 0, packed: bool = False,
            segment_multiple: int = 1) -> tuple[list[list[int]], tuple[int, int] | None]:
    """make_micro_batches' groups of sample indices (padding ones included) and uniform shape."""
    lengths = [x.num_tokens for x in samples]
    shape = None
    if packed:
        # each sample's slot; the ranks' agreed longest too, so that a rank whose own slots round past
        # it gets the shape every other rank gets
        lengths = [_round_up(n, segment_multiple) for n in lengths]
        uniform_length = _round_up(uniform_length, segment_multiple)
        if uniform:
            shape = uniform_shape(max(lengths + [uniform_length], default=1), max_tokens=max_tokens,
                                  micro_batch_size=micro_batch_size, multiple=multiple, packed=True)
        plan = plan_packs(lengths, max_tokens=shape[1] if shape else max_tokens, micro_batch_size=micro_batch_size,
                          multiple=multiple)
    elif uniform:
        shape = uniform_shape(max(lengths + [uniform_length], default=1), max_tokens=max_tokens,
                              micro_batch_size=micro_batch_size, multiple=multiple)
        plan = plan_micro_batches(lengths, max_tokens=0, micro_batch_size=shape[0])
    else:
        plan = plan_micro_batches(lengths, max_tokens=max_tokens, micro_batch_size=micro_batch_size,
                                  multiple=multiple)
    count = _round_up(max(len(plan), min_count, 1), count_multiple)
    return plan + [[] for _ in range(count - len(plan))], shape


def split_for_data_parallel(samples: Sequence[Sample], num_ranks: int) -> list[list[int]]:
    """Sample indices per DP rank, balancing tokens: longest first, each to the rank with the
    fewest tokens so far (ties: fewer samples, then lower rank). Indices stay in input order."""
    loads = [(0, 0, rank) for rank in range(num_ranks)]
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        tokens, count, rank = min(loads)
        shards[rank].append(i)
        loads[rank] = (tokens + samples[i].num_tokens, count + 1, rank)
    return [sorted(shard) for shard in shards]


def unpack_responses(values: Sequence[Tensor], micro_batches: Sequence[MicroBatch],
                     num_samples: int) -> list[Tensor]:
    """Per-position values of each micro-batch ([b, s], aligned with labels, e.g. log-probs) ->
    one [R] tensor per sample, in the order of the list the micro-batches were built from."""
    out: list[Tensor | None] = [None] * num_samples
    for value, mb in zip(values, micro_batches):
        flat = value.reshape(-1)
        for i, first, p, r in zip(mb.sample_index, mb.entry_offsets(), mb.prompt_lengths, mb.response_lengths):
            if i >= 0:
                out[i] = flat[first + p - 1: first + p - 1 + r]
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise ValueError(f"samples {missing[:8]} are in none of the micro-batches")
    return out
