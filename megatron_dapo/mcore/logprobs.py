"""Token log-probs and entropy from vocab-parallel logits: fp32, no vocabulary all-gather, chunked.

Each tensor-parallel rank holds the logits of a contiguous vocabulary slice
[rank * V_local, (rank + 1) * V_local). Per token, with x = logits / temperature:

    S       = sum_v exp(x_v - M),                 M = max_v x_v
    log p_t = (x_t - M) - log S                   (t = the target token)
    H       = log S - sum_v p_v (x_v - M)         (entropy)

Each sum is a local partial followed by one all-reduce over the TP group: one MAX (for M) and one
SUM of the three stacked partials per chunk, i.e. O(tokens) bytes on the wire, never O(vocab).

Memory. The loop runs over chunks of tokens and keeps two or three fp32 [chunk, V_local] work
buffers, whatever the sequence length. Backward recomputes the softmax per chunk from the saved
per-token M, log S and E_p[x - M] (no collective) and writes into one gradient buffer shaped like
the logits (which autograd needs anyway; for fp32 logits it doubles as the work buffer). Unlike
megatron's vocab_parallel_cross_entropy, the input logits are never modified in place.
``vocab_parallel_logprobs_from_hidden`` goes one step further and fuses the output projection
into the loop, so no [tokens, V_local] tensor exists at all (benchmarks/logprobs.py measures both).

Gradients in the forward (``GradHint``). Recomputing a chunk's logits in backward costs one more
[chunk, H] x [H, V_local] matmul, a quarter of the output layer's work (forward, recompute, input
and weight gradients). When the caller can tell, from a chunk's log-probs alone, the gradient the
loss will send them (a token-mean loss is a sum of per-token terms: train_step.py), the forward
computes the input and weight gradients while the chunk's logits exist, as Liger-Kernel's
fused linear cross-entropy does for a scalar loss (github.com/linkedin/Liger-Kernel,
ops/fused_linear_cross_entropy.py). Backward then only checks that the gradient that arrived is
that hint times one scalar (the schedule's loss scaling) and scales; anything else (another loss,
an entropy gradient) falls back to the recompute, so the hint can cost time but never correctness.
``SHORTCUT_STATS`` counts both outcomes, so that a silent fallback shows up (train_step.py reports
them per update as actor/grad_shortcut_used and actor/grad_shortcut_fallbacks).
Positions the hint marks inactive (masked out of the loss: prompts, padding) have no gradient:
the loop runs them first, in chunks of their own, and skips those chunks' gradient matmuls.

Padded vocabulary rows (a multiple of lcm(divisible_by, TP), see model.padded_vocab_size) are not
tokens: ``valid_vocab_size`` excludes them from the softmax, so log-probs match an unpadded model
(and the rollout engine) exactly.

Gradients: d log p_t / dx_v = [v = t] - p_v;  dH / dx_v = -p_v (x_v - E_p[x]).
References: NeMo-Aligner / NeMo-RL DistributedLogprob and ChunkedDistributedLogprob
(docs/reference/nvidia_stack.md 1.3, 2.6) for the TP scheme; the entropy gradient is derived above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.mcore import logprob_chunks as chunks

# The upstream gradient counts as the hint times a scalar when it is within this fraction of its
# largest entry (fp32 rounding of the schedule's loss scaling is ~1e-7 of each entry).
_HINT_RTOL = 1e-5


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None = None,
    valid_vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each position's distribution.

    Args:
        logits: [..., V_local] this rank's vocabulary slice (any float dtype; any leading shape,
            e.g. [b, s] from GPTModel or [s, b] or [tokens]). Not modified.
        target: [...] global token ids, aligned with logits (the token that position predicts).
            Ids outside [0, valid_vocab_size) (e.g. -100 padding) give finite garbage to mask out.
        temperature: the rollout sampling temperature; logits are divided by it first.
        tp_group: the tensor-parallel group the vocabulary is split over; None = not split.
        valid_vocab_size: the real vocabulary size (columns beyond it are padding); None = all.
        chunk_tokens: tokens per chunk; None: logprob_chunks.DEFAULT_CHUNK_TOKENS within DEFAULT_CHUNK_BYTES.

    Returns:
        (log_probs, entropy): both [...] fp32. Both are differentiable (entropy for an entropy
        bonus); under torch.no_grad() nothing is kept for backward (old-policy log-probs).
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits shape without the "
                         f"vocabulary dim {tuple(logits.shape[:-1])}")
    shard = chunks.Shard(logits.shape[-1], tp_group, valid_vocab_size, temperature, chunk_tokens)
    return _VocabParallelLogProbs.apply(logits, target, shard)


def vocab_parallel_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None = None,
    valid_vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    grad_hint: GradHint | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from the last hidden states, with the output projection fused into the chunk loop:
    no [tokens, V_local] tensor exists at all, in forward or backward (memory O(chunk x V_local)).

    Args:
        hidden: [..., H] final-norm hidden states, the full sequence, the same on every TP rank.
            Its gradient is this rank's partial sum over its vocabulary slice: pass it through
            megatron's copy_to_tensor_model_parallel_region (or, under sequence parallelism,
            gather_from_sequence_parallel_region) as ColumnParallelLinear does; see
            ``logprobs_output_processor``.
        weight: [V_local, H] this rank's output-layer (or tied embedding) rows.
        target, temperature, tp_group, valid_vocab_size, chunk_tokens: as in vocab_parallel_logprobs.
        grad_hint: the gradient backward is expected to bring the log-probs (``GradHint``, over
            the flattened leading dims); only used when hidden or weight requires grad. None:
            recompute in backward (the module docstring).

    Returns:
        (log_probs, entropy): both [...] fp32, differentiable w.r.t. hidden and weight (the
        weight gradient is accumulated in fp32 and returned in the weight's dtype).
    """
    if target.shape != hidden.shape[:-1] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"need hidden [..., H], weight [V_local, H], target [...]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}")
    shard = chunks.Shard(weight.shape[0], tp_group, valid_vocab_size, temperature, chunk_tokens)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        grad_hint = None
    return _HiddenLogProbs.apply(hidden, weight, target, shard, grad_hint)


@dataclass(frozen=True)
class GradHint:
    """What the loss will do with the log-probs, for the fused output layer's gradients in the
    forward (the module docstring). Positions index the flattened log-probs (``log_probs.reshape(-1)``).

    grad(index, log_probs) -> [C]: d loss / d log p at positions ``index`` ([C] int64, on the
        log-probs' device) given their log-probs ([C] fp32, detached), up to one scalar factor
        common to all positions (a loss scale).
    active: [N] bool on the CPU (no device sync to read it), False where the gradient is known to
        be exactly 0 (positions masked out of the loss); None: all positions may have one.
    """

    grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    active: torch.Tensor | None = None


@dataclass
class ShortcutStats:
    """How often the hinted output layer's backward took the forward's gradients (``used``) and
    how often the gradient that arrived was not the hint times a scalar, so it recomputed
    (``fallbacks``): one count per hinted ``_HiddenLogProbs`` backward (a micro-batch on the last
    pipeline stage). A fallback is still exact but costs the saved work twice over, so a run whose
    fallbacks are not 0 has a hint that no longer matches its loss. Calls without a hint count
    in neither. Process-wide (``SHORTCUT_STATS``); not thread-safe (autograd runs this on one thread).
    """

    used: int = 0
    fallbacks: int = 0

    def record(self, *, used: bool) -> None:
        if used:
            self.used += 1
        else:
            self.fallbacks += 1

    def reset(self) -> None:
        self.used = self.fallbacks = 0

    def snapshot(self) -> "ShortcutStats":
        """A copy, unaffected by later counts."""
        return ShortcutStats(used=self.used, fallbacks=self.fallbacks)

    def since(self, earlier: "ShortcutStats") -> "ShortcutStats":
        """The counts added after ``earlier`` (a snapshot): a window without resetting the
        counter under anyone else's feet."""
        return ShortcutStats(used=self.used - earlier.used, fallbacks=self.fallbacks - earlier.fallbacks)


SHORTCUT_STATS = ShortcutStats()


def logprobs_output_processor(target_bs: torch.Tensor, *, temperature: float, valid_vocab_size: int | None,
                              chunk_tokens: int | None = None, grad_hint: GradHint | None = None):
    """A ``GPTModel.forward(output_processor=...)`` hook (megatron-core 0.19.2) that returns
    (log_probs, entropy), each [b, s] fp32, instead of logits: the fused path above, with the
    output layer's own TP / sequence-parallel input handling. target_bs: [b, s] token ids;
    grad_hint: over the [b, s] positions (``target_bs.reshape(-1)``)."""
    if grad_hint is not None:  # the loop runs over [s, b]: position i there is sb_to_bs[i] here
        b, s = target_bs.shape
        sb_to_bs = torch.arange(b * s, device=target_bs.device).view(b, s).t().reshape(-1)
        outer = grad_hint
        grad_hint = GradHint(grad=lambda index, lp: outer.grad(sb_to_bs[index], lp),
                             active=None if outer.active is None else outer.active.view(b, s).t().reshape(-1))
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    def processor(*, hidden_states, output_layer, output_weight, **_):
        weight = output_layer.weight if output_weight is None else output_weight
        group = output_layer.tp_group
        if output_layer.sequence_parallel:  # [s/TP, b, H] -> [s, b, H]; backward reduce-scatters
            hidden = gather_from_sequence_parallel_region(hidden_states, group=group)
        else:  # identity; backward all-reduces the partial hidden-state gradients
            hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
        group = group if dist.is_initialized() and dist.get_world_size(group) > 1 else None
        lp, ent = vocab_parallel_logprobs_from_hidden(
            hidden, weight, target_bs.t(), temperature=temperature, tp_group=group,
            valid_vocab_size=valid_vocab_size, chunk_tokens=chunk_tokens, grad_hint=grad_hint)
        return lp.t(), ent.t()  # [s, b] -> [b, s]

    return processor


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, shard):
        ctx.set_materialize_grads(False)
        flat = logits.reshape(-1, logits.shape[-1])  # a view for contiguous logits
        lp, ent, stats = chunks.run_forward(ctx, flat.shape[0], target, shard, lambda rows: flat[rows])
        ctx.save_for_backward(logits, target, stats)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, target, stats = ctx.saved_tensors
        shard, (g_lp, g_h) = ctx.shard, chunks.grads_out(grad_log_probs, grad_entropy)
        flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        grad = torch.empty_like(flat)
        grad[:, shard.valid:] = 0  # padding columns
        fp32 = grad.dtype == torch.float32  # then compute straight in the gradient buffer
        buffers = chunks.work_buffers(1 if fp32 else 2, min(flat.shape[0], shard.chunk), shard, grad.device)
        for start in range(0, flat.shape[0], shard.chunk):
            rows = slice(start, min(start + shard.chunk, flat.shape[0]))
            c, out = rows.stop - rows.start, grad[rows, :shard.valid]
            x = chunks.chunk_backward(flat[rows], tgt[rows], shard, *stats[:, rows],
                                None if g_lp is None else g_lp[rows], None if g_h is None else g_h[rows],
                                out if fp32 else buffers[1][:c], buffers[0][:c])
            if not fp32:
                out.copy_(x)
        return grad.view_as(logits), None, None


class _HiddenLogProbs(torch.autograd.Function):
    """The output layer fused in: logits exist one chunk at a time, in forward and backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, shard, grad_hint):
        ctx.set_materialize_grads(False)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if grad_hint is None:
            logits_of = chunks.chunk_projection(flat, weight, shard)
            lp, ent, stats = chunks.run_forward(ctx, flat.shape[0], target, shard, logits_of)
            ctx.early = None
        else:
            lp, ent, stats, ctx.early = _forward_with_grads(ctx, flat, weight, target, shard, grad_hint)
        ctx.save_for_backward(hidden, weight, target, stats)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, target, stats = ctx.saved_tensors
        early, ctx.early = ctx.early, None
        grads = None if early is None else early.scaled(grad_log_probs, grad_entropy)
        if early is not None:
            SHORTCUT_STATS.record(used=grads is not None)
        if grads is not None:
            return grads[0].view_as(hidden), grads[1].to(weight.dtype), None, None, None
        shard, (g_lp, g_h) = ctx.shard, chunks.grads_out(grad_log_probs, grad_entropy)
        flat, tgt, w = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), weight[:shard.valid]
        grad_hidden = torch.empty_like(flat)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # accumulates
        buffers = chunks.work_buffers(2, min(flat.shape[0], shard.chunk), shard, hidden.device)
        logits_of = chunks.chunk_projection(flat, weight, shard)
        for start in range(0, flat.shape[0], shard.chunk):
            rows = slice(start, min(start + shard.chunk, flat.shape[0]))
            c = rows.stop - rows.start
            gx = chunks.chunk_backward(logits_of(rows), tgt[rows], shard, *stats[:, rows],
                                 None if g_lp is None else g_lp[rows], None if g_h is None else g_h[rows],
                                 buffers[1][:c], buffers[0][:c])
            chunks.accumulate_output_grads(gx, w, flat[rows], grad_hidden, rows, grad_weight[:shard.valid])
        return grad_hidden.view_as(hidden), grad_weight.to(weight.dtype), None, None, None


def _forward_with_grads(ctx, flat, weight, target, shard, hint: GradHint):
    """chunks.run_forward plus the gradients for ``hint`` (an _EarlyGrads), with the rows reordered so
    that the inactive ones come first, in chunks of their own; results in the original order."""
    n, shape = flat.shape[0], target.shape
    order = None
    if hint.active is not None:
        active = hint.active.reshape(-1).bool().cpu()
        order = torch.cat([torch.nonzero(~active).view(-1), torch.nonzero(active).view(-1)])
        active_run = active[order]
        order = order.to(flat.device)
        flat, target = flat.index_select(0, order), target.reshape(-1).index_select(0, order)
    early = _EarlyGrads(flat, weight, shard, hint, order, None if order is None else active_run)
    logits_of = chunks.chunk_projection(flat, weight, shard)
    lp, ent, stats = chunks.run_forward(ctx, n, target, shard, logits_of, on_chunk=early.chunk)
    early.finish()
    if order is None:
        return lp, ent, stats, early
    unordered = torch.empty_like(stats)
    unordered[:, order] = stats
    lp_ent = torch.empty(2, n, dtype=lp.dtype, device=lp.device)
    lp_ent[:, order] = torch.stack([lp.reshape(-1), ent.reshape(-1)])
    return lp_ent[0].view(shape), lp_ent[1].view(shape), unordered, early


class _EarlyGrads:
    """The input and weight gradients of _HiddenLogProbs for the upstream gradient a GradHint
    predicts, accumulated chunk by chunk in the forward (the module docstring). Rows arrive in
    the loop's order: ``order[i]`` is the original position of row i (None: the same)."""

    def __init__(self, flat, weight, shard, hint: GradHint, order, active_run):
        self.flat, self.weight, self.shard, self.hint = flat, weight[:shard.valid], shard, hint
        self.order, self.active_run = order, active_run
        self.expected = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
        self.grad_hidden = torch.zeros_like(flat)
        self.grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def chunk(self, rows, target, log_probs, log_sum, exp):
        """exp: [C, valid] exp(x - M), overwritten with d log p . g / d logits = (onehot - p) g / T."""
        if self.active_run is not None and not self.active_run[rows].any():
            return  # masked out of the loss: no gradient (expected and grad_hidden stay 0)
        index = (torch.arange(rows.start, rows.stop, device=self.flat.device) if self.order is None
                 else self.order[rows])
        g = self.hint.grad(index, log_probs.detach()).float().reshape(-1)
        self.expected[rows] = g
        gx = exp.mul_((g / -self.shard.temperature * torch.exp(-log_sum))[:, None])  # p = exp(x - M) / S
        chunks.add_target_term(gx, target, self.shard, g)
        chunks.accumulate_output_grads(gx, self.weight, self.flat[rows], self.grad_hidden, rows,
                                 self.grad_weight[:self.shard.valid])

    def finish(self):
        """Back to the original row order; drop all but the gradients."""
        if self.order is not None:
            expected, grad_hidden = torch.empty_like(self.expected), torch.empty_like(self.grad_hidden)
            expected[self.order], grad_hidden[self.order] = self.expected, self.grad_hidden
            self.expected, self.grad_hidden = expected, grad_hidden
        self.flat = self.weight = self.hint = self.order = self.active_run = None

    def scaled(self, grad_log_probs, grad_entropy):
        """(grad_hidden, grad_weight) when grad_log_probs = c x the hint (and no entropy
        gradient), else None (the caller recomputes). One host sync."""
        if grad_entropy is not None or grad_log_probs is None:
            return None
        g, h = grad_log_probs.reshape(-1).float(), self.expected
        # c = 0 when the hint is all zero (dot(g, h) is 0 then): no host sync to test for it
        c = torch.dot(g, h) / torch.dot(h, h).clamp(min=torch.finfo(torch.float32).tiny)
        if not (g - c * h).abs().max() <= _HINT_RTOL * g.abs().max():
            return None
        return self.grad_hidden.mul_(c.to(self.grad_hidden.dtype)), self.grad_weight.mul_(c)
