"""The per-chunk kernels behind mcore/logprobs.py: one chunk of tokens' softmax statistics over this
rank's vocabulary slice (forward), its logit gradient (backward), and the output layer's gradients
from it, with the buffers they reuse across chunks. Plain functions on tensors and a TP group; the
autograd Functions, the gradient hint and the public entry points that loop over them are in
logprobs.py, whose docstring has the math.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The loop keeps three [chunk, V_local] buffers (the chunk's logits, in the weight's dtype, and two
# fp32 work buffers), allocated once per call. Chunks are DEFAULT_CHUNK_TOKENS tokens, fewer where
# an fp32 buffer would pass DEFAULT_CHUNK_BYTES (V_local > ~160k): ~470 MB of buffers at
# V_local = 152064, ~25 MB at 8192. The token count is what the CPU GEMMs need: at hidden 512,
# V = 152064 and 2 threads the log-prob path of a 4096-token update took ~10.2 s with 110-token
# chunks (the earlier 64 MiB rule), ~9.0 s with 263 and no less with 526 or 1024; the
# [chunk, V] x [V, H] input-gradient matmul ran at half speed at 110 rows (benchmarks/train_step.py).
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_CHUNK_BYTES = 160 * 2**20


class Shard:
    """Where this rank's vocabulary slice sits, and the arguments shared by both entry points."""

    def __init__(self, v_local, tp_group, valid_vocab_size, temperature, chunk_tokens):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        valid = v_local * world if valid_vocab_size is None else valid_vocab_size
        if not 0 < valid <= v_local * world:
            raise ValueError(f"valid_vocab_size={valid_vocab_size} must be in (0, {v_local * world}]")
        self.group, self.temperature = tp_group, float(temperature)
        self.start = rank * v_local
        self.valid = max(0, min(v_local, valid - self.start))  # a rank may hold only padding
        within_bytes = DEFAULT_CHUNK_BYTES // (4 * max(self.valid, 1))
        self.chunk = chunk_tokens or max(1, min(DEFAULT_CHUNK_TOKENS, within_bytes))


def chunk_forward(logits, target, shard, buffers):
    """logits: [C, V_local] this chunk's raw logits, any dtype (read only); buffers: two fp32
    [>= C, valid] work buffers, reused across chunks (on return buffers[1][:C] holds exp(x - M)).
    Returns the per-token (M, log S, E_p[x - M], log p, entropy), each [C] fp32, reduced over
    the TP group."""
    raw = logits[:, :shard.valid]
    # max commutes with dividing by T > 0, so take it on the raw logits (no scaled copy yet).
    m = (raw.amax(-1).float() / shard.temperature if shard.valid
         else raw.new_full((raw.shape[0],), float("-inf"), dtype=torch.float32))
    if shard.group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
    # x - M = logits / T - M in one fp32 pass. Everything below works on x - M (<= 0):
    # subtracting M from a log-sum or a mean afterwards would cost precision at large |logits|.
    x = torch.add(-m[:, None], raw, alpha=1.0 / shard.temperature, out=buffers[0][: raw.shape[0]])
    exp = torch.exp(x, out=buffers[1][: raw.shape[0]])
    local_t, in_shard = local_target(target, shard)
    target_x = (torch.where(in_shard, x.gather(1, local_t[:, None]).squeeze(1), 0.0) if shard.valid
                else torch.zeros_like(m))
    # One all-reduce for the three partial sums: sum exp, the target's shifted logit (only its
    # owner has it), and sum exp * shifted logit, multiplied into x's buffer (x is not needed after
    # this; no [C, V] temporary). A batched dot product (bmm [C, 1, V] x [C, V, 1]) does the same
    # more slowly on CPU (docs/performance.md, benchmarks/train_step.py).
    stats = torch.stack([exp.sum(-1), target_x, x.mul_(exp).sum(-1)])
    if shard.group is not None:
        dist.all_reduce(stats, group=shard.group)
    log_sum, mean_shifted = torch.log(stats[0]), stats[2] / stats[0]
    return m, log_sum, mean_shifted, stats[1] - log_sum, log_sum - mean_shifted


def chunk_backward(logits, target, shard, m, log_sum, mean_shifted, g_lp, g_h, out, probs):
    """d(g_lp . log p + g_h . H) / d logits for one chunk: [C, valid] fp32, written into ``out``
    (e.g. the gradient buffer itself); probs: a [C, valid] fp32 work buffer (used only for an
    entropy gradient). logits: [C, V_local] raw, read only.

    With log p = x - M - log S, d log p_t / dx = onehot(t) - p and dH/dx = -p (log p + H), so
    d/d logits = -(p / T) (g_h (log p + H) + g_lp) + onehot(t) g_lp / T  (T the temperature).
    Without an entropy gradient that is three passes over the chunk and no other buffer."""
    t = shard.temperature
    g_lp = torch.zeros_like(m) if g_lp is None else g_lp
    x = torch.add(-(m + log_sum)[:, None], logits[:, :shard.valid], alpha=1.0 / t, out=out)  # log p
    if g_h is None:
        x.exp_().mul_((g_lp / -t)[:, None])
    else:
        torch.exp(x, out=probs)
        x.mul_((g_h / -t)[:, None]).add_((((log_sum - mean_shifted) * g_h + g_lp) / -t)[:, None])
        x.mul_(probs)
    return add_target_term(x, target, shard, g_lp)


def add_target_term(gx, target, shard, g_lp):
    """gx += onehot(target) g_lp / T on this rank's vocabulary slice: the log p gradient's own-token
    term, for the backward and for the forward's early gradients alike. gx: [C, valid] fp32."""
    if shard.valid:
        local_t, in_shard = local_target(target, shard)
        gx.scatter_add_(1, local_t[:, None], torch.where(in_shard, g_lp / shard.temperature, 0.0)[:, None])
    return gx


def accumulate_output_grads(gx, weight, hidden_rows, grad_hidden, rows, grad_weight):
    """The output layer's gradients from a chunk's logit gradient gx ([C, valid] fp32): writes
    grad_hidden[rows] = gx @ weight and adds gx^T @ hidden_rows into grad_weight (fp32, in place:
    no [V, H] temporary). weight, grad_weight: the [valid, H] rows."""
    grad_hidden[rows] = (gx.to(weight.dtype) @ weight).to(grad_hidden.dtype)
    grad_weight.addmm_(gx.t(), hidden_rows.float())


def run_forward(ctx, n, target, shard, logits_of, on_chunk=None):
    """Loop over token chunks; logits_of(rows) gives [C, V_local] logits of those tokens.
    on_chunk(rows, target, log_probs, log_sum, exp): called after each chunk with its [C, valid]
    buffer exp(x - M), which it may overwrite."""
    tgt = target.reshape(-1)
    stats = torch.empty(3, n, dtype=torch.float32, device=target.device)  # M, log S, E_p[x - M]
    log_probs, entropy = torch.empty_like(stats[0]), torch.empty_like(stats[0])
    buffers = work_buffers(2, min(n, shard.chunk), shard, target.device)
    for start in range(0, n, shard.chunk):
        rows = slice(start, min(start + shard.chunk, n))
        m, log_sum, mean, log_probs[rows], entropy[rows] = chunk_forward(
            logits_of(rows), tgt[rows], shard, buffers)
        stats[:, rows] = torch.stack([m, log_sum, mean])
        if on_chunk is not None:
            on_chunk(rows, tgt[rows], log_probs[rows], log_sum, buffers[1][: rows.stop - rows.start])
    ctx.shard = shard
    return log_probs.view(target.shape), entropy.view(target.shape), stats


def work_buffers(count, rows, shard, device):
    """fp32 [rows, valid] buffers allocated once per call: reusing them (instead of allocating per
    chunk) keeps the CPU allocator from returning and page-faulting the memory on every chunk."""
    return [torch.empty(rows, shard.valid, dtype=torch.float32, device=device) for _ in range(count)]


def chunk_projection(hidden, weight, shard):
    """rows -> hidden[rows] @ weight.T ([C, V_local], weight's dtype) in one reused buffer."""
    out = torch.empty(min(hidden.shape[0], shard.chunk), weight.shape[0], dtype=weight.dtype,
                      device=weight.device)
    return lambda rows: torch.matmul(hidden[rows], weight.t(), out=out[: rows.stop - rows.start])


def grads_out(grad_log_probs, grad_entropy):
    # Both Functions set_materialize_grads(False): an output nobody differentiates (the entropy,
    # usually) arrives as None, so backward skips its terms instead of multiplying zeros.
    g_lp = None if grad_log_probs is None else grad_log_probs.reshape(-1).float()
    g_h = None if grad_entropy is None else grad_entropy.reshape(-1).float()
    return g_lp, g_h


def local_target(target: torch.Tensor, shard: Shard):
    """Column of each target in this shard (0 where it is not here) and whether it is here."""
    local = target - shard.start
    in_shard = (local >= 0) & (local < shard.valid)
    return torch.where(in_shard, local, 0), in_shard
