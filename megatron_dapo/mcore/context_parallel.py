"""Context parallelism (CP): each rank of a CP group holds a share of every sequence's positions.

The layout is megatron's load-balanced one (``megatron.core.utils.get_batch_on_this_cp_rank``, which
its RoPE follows: ``get_pos_emb_on_this_cp_rank``): a row of s positions is cut into 2 x CP chunks
of s / (2 CP), and CP rank r holds chunks r and 2 CP - 1 - r, so that under a causal mask every rank
attends to about as many keys (a rank holding only the last chunks would do most of the work).

What crosses the CP ranks, and why this much:
- **attention** (``cp_attention``, the local spec's core attention at CP > 1): each rank's queries
  attend to the keys and values of the whole row, all-gathered over CP (an all-gather of K and V,
  the simplest exact form; a ring would overlap it with compute, which matters on a GPU, where the
  TE spec's own CP attention runs instead);
- **the output** (``gather_sequence``): after the output layer each rank holds its positions'
  log-probs and entropies, [b, s / CP]; they are all-gathered back to whole rows, [b, s], so that
  the loss, every aggregation mode (seq-mean and GSPO's sequence ratio need whole sequences), the
  metrics and the forward-only log-prob pass are the CP = 1 code on the same values. Every CP rank
  then computes the same loss; the train step divides it by CP (train_step.py), and the gather's
  backward (a sum over CP of the gradient at each rank's positions) gives each rank the gradient of
  its own positions exactly once. Cheap: b x s floats against the hidden states' b x s x h.
The token and sequence counts of the loss come from the samples, which every CP rank of a DP rank
holds whole, and are gathered over DP only: no token is counted once per CP rank.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


Bounds = tuple[int, ...]  # a row's segments: (0, s) for a padded row; a packed row's cu_seqlens


def cp_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) that CP rank ``cp_rank`` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside a CP group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def positions_on_rank(seq_len: int, cp_size: int, cp_rank: int, bounds: Bounds | None = None) -> torch.Tensor:
    """[seq_len / cp_size] int64: the row positions CP rank ``cp_rank`` holds, in its order: of each
    segment (``bounds``; the whole row when None) its two chunks, segment after segment (megatron's
    per-sequence split of a packed row, which its THD RoPE follows). Cached: every layer's K/V gather
    of a micro-batch asks for the same index; callers only read it."""
    return _positions(seq_len, cp_size, cp_rank, bounds or (0, seq_len))


@functools.lru_cache(maxsize=256)
def _positions(seq_len: int, cp_size: int, cp_rank: int, bounds: Bounds) -> torch.Tensor:
    if bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(f"segment bounds {bounds[0]} .. {bounds[-1]} do not cover the {seq_len} positions")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = _chunk_len(end - start, cp_size)
        pieces += [torch.arange(start + c * chunk, start + (c + 1) * chunk) for c in cp_chunks(cp_size, cp_rank)]
    return torch.cat(pieces)


def slice_for_rank(values: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1,
                   bounds: Bounds | None = None) -> torch.Tensor:
    """[..., s, ...] -> [..., s / cp_size, ...]: the positions (along ``dim``) this CP rank holds."""
    if cp_size == 1:
        return values
    index = positions_on_rank(values.shape[dim], cp_size, cp_rank, bounds).to(values.device)
    return values.index_select(dim, index)


def restore_order(pieces: list[torch.Tensor], dim: int, bounds: Bounds | None = None) -> torch.Tensor:
    """Every CP rank's share (``slice_for_rank`` of rank 0, 1, ...), each [..., s / CP, ...] along
    ``dim`` -> the whole row, [..., s, ...], positions in order."""
    whole = torch.cat(pieces, dim=dim)
    return whole.index_select(dim, _restore_index(whole.shape[dim], len(pieces), bounds).to(whole.device))


@functools.lru_cache(maxsize=256)
def _restore_index(seq_len: int, cp_size: int, bounds: Bounds | None) -> torch.Tensor:
    """Position j of the row <- where the concatenated shares of ranks 0, 1, ... hold it."""
    held = torch.cat([positions_on_rank(seq_len, cp_size, rank, bounds) for rank in range(cp_size)])
    return torch.argsort(held)


def _chunk_len(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_len} positions does not split into 2 x CP = {2 * cp_size} chunks; "
                         "batching pads rows (and packed samples' slots) to a multiple of it")
    return seq_len // (2 * cp_size)


class _GatherSequence(torch.autograd.Function):
    """Forward: every CP rank's share -> the whole row on every rank. Backward: the whole row's
    gradient summed over the CP ranks (each rank's loss may read every position), this rank's
    positions of it."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, dim: int, group, bounds: Bounds | None):
        ctx.dim, ctx.group, ctx.bounds = dim, group, bounds
        return _gather_whole(values, dim, group, bounds)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return slice_for_rank(grad, size, rank, dim=ctx.dim, bounds=ctx.bounds), None, None, None


def gather_sequence(values: torch.Tensor, group, dim: int = 1, bounds: Bounds | None = None) -> torch.Tensor:
    """[..., s / CP, ...] on each CP rank -> [..., s, ...] on every one, differentiable (see the
    module docstring for the backward). ``bounds``: a packed row's segments (global positions)."""
    if dist.get_world_size(group) == 1:
        return values
    if not (torch.is_grad_enabled() and values.requires_grad):
        return _gather_whole(values, dim, group, bounds)
    return _GatherSequence.apply(values, dim, group, bounds)


def _gather_whole(values: torch.Tensor, dim: int, group, bounds: Bounds | None) -> torch.Tensor:
    pieces = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, values.contiguous(), group=group)
    return restore_order(pieces, dim, bounds)


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, group,
                 enable_gqa: bool) -> torch.Tensor:
    """Causal self-attention of this CP rank's positions over the whole row.

    query: [b, heads, s / CP, d], key and value: [b, kv_heads, s / CP, d], each in this rank's
    order (``positions_on_rank``). Returns [b, heads, s / CP, d]. Right padding sits after a row's
    tokens, so the causal mask alone keeps it out of their attention, as at CP = 1.
    """
    whole_key, whole_value = (gather_sequence(t, group, dim=2) for t in (key, value))  # [b, kv_heads, s, d]
    return _own_chunks(query, whole_key, whole_value, group, scale=scale, enable_gqa=enable_gqa)


def cp_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: Bounds, *,
                        scale: float, group, enable_gqa: bool) -> torch.Tensor:
    """``cp_attention`` for a packed row (THD): query [t / CP, heads, d], key and value
    [t / CP, kv_heads, d], this rank's chunks of each segment (``bounds``, the row's cu_seqlens),
    segment after segment. Each segment's queries attend within it. Returns [t / CP, heads * d]."""
    size = dist.get_world_size(group)
    whole_key, whole_value = (gather_sequence(t, group, dim=0, bounds=bounds) for t in (key, value))  # [t, ...]
    out, local = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = (end - start) // size
        q = query[local:local + n].transpose(0, 1)[None]  # [1, heads, n, d]
        k, v = (t[start:end].transpose(0, 1)[None] for t in (whole_key, whole_value))
        piece = _own_chunks(q, k, v, group, scale=scale, enable_gqa=enable_gqa)
        out.append(piece[0].transpose(0, 1).reshape(n, -1))
        local += n
    return torch.cat(out)


def _own_chunks(query: torch.Tensor, whole_key: torch.Tensor, whole_value: torch.Tensor, group, *, scale: float,
                enable_gqa: bool) -> torch.Tensor:
    """This rank's two query chunks of one sequence ([b, heads, L / CP, d]) over its whole keys and
    values ([b, kv_heads, L, d]): each chunk attends to the keys up to its own last position,
    causally, through a [chunk, keys] boolean mask, which torch's fused CPU kernel takes as it is
    (measured: no [heads, chunk, keys] probabilities kept for backward; 430 MB peak for a 2048-query
    chunk over 8192 keys and 8 heads, whose probabilities alone would be 537 MB)."""
    from torch.nn.functional import scaled_dot_product_attention

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = whole_key.shape[2] // (2 * size)
    outputs = []
    for piece, c in zip(query.chunk(2, dim=2), cp_chunks(size, rank)):
        end = (c + 1) * chunk
        rows = torch.arange(c * chunk, end, device=query.device)[:, None]
        allowed = torch.arange(end, device=query.device)[None, :] <= rows  # [chunk, end]: True = attend
        outputs.append(scaled_dot_product_attention(piece, whole_key[:, :, :end], whole_value[:, :, :end],
                                                    attn_mask=allowed, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(outputs, dim=2)
