"""Host memory of a checkpoint save with the distributed optimizer (docs/checkpoints_memory.md), for
the plan (memory_plan.py): megatron's fully reshardable format gathers the TP x PP shard's fp32
master + Adam m, v (12 B/param) into CPU tensors, on DP rank 0 (``memory_efficient_save``) or on
every DP rank; a background write (``async_save``) keeps that gathered state and a host copy of the
rank's weights until its child has written them."""

from __future__ import annotations

from dataclasses import dataclass

# megatron DDP's bucket with overlapped gradient reduction (the GPU default here): max(40M, 1M x DP)
# parameters (distributed/distributed_data_parallel.py); a save's gather receives one at a time.
DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_DP = 40_000_000, 1_000_000
# Assumed, not measured (no cluster here): a parallel file system's write bandwidth per client node,
# and what a node's DP-rank-0 ranks receive per second in the optimizer's gloo gather. They size a
# save's time (``save_seconds``) and so the lead a stop's warning signal needs; a run measures its own.
FS_WRITE_BYTES_PER_S_PER_NODE = 2e9
GATHER_BYTES_PER_S_PER_NODE = 10e9


@dataclass(frozen=True)
class SaveHost:
    """Host bytes of a checkpoint with the distributed optimizer (docs/checkpoints_memory.md): its
    fully reshardable format gathers the TP x PP shard's fp32 master + Adam m, v (12 B/param)."""

    dp_rank0: float  # a DP-rank-0 rank's peak during a save: the gathered shard, its slice of a bucket, a bucket
    other: float  # any other rank's (memory_efficient_save: its slice of a bucket only; else as DP rank 0)
    worst_node: float  # the node that holds the DP-rank-0 ranks of a pipeline stage
    resume: float  # every rank on a resume, either setting: the whole shard's state beside a bucket's slice
    background: float = 0.0  # async_save: what a DP-rank-0 rank holds until its write ends (0: one-phase saves)
    background_node: float = 0.0  # the same for the node of a stage's DP-rank-0 ranks
    written_node: float = 0.0  # bytes a save writes from that node (its ranks hold every main replica)
    gathered_node: float = 0.0  # bytes that node's ranks receive in the optimizer's gather


def save_seconds(save: SaveHost) -> float:
    """A one-phase save's time on the busiest node, at the assumed bandwidths above."""
    return save.written_node / FS_WRITE_BYTES_PER_S_PER_NODE + save.gathered_node / GATHER_BYTES_PER_S_PER_NODE


def save_host(on_rank: float, *, tp: int, dp: int, gpus_per_node: int, memory_efficient: bool,
              background: bool = False, weight_bytes: int = 2) -> SaveHost:
    """``on_rank``: parameters of the rank's TP x PP shard. Rank order is TP fastest, then DP
    (parallel_state's tp-cp-ep-dp-pp), so a node holds min(TP, its GPUs) ranks of DP index 0.
    ``background``: the write runs in a child, which holds the gathered state (not freed when the
    trainer goes on) and the host copy of the rank's weights (``weight_bytes`` a parameter; DP rank 0
    holds the main replicas, the only ones written) until written; the other DP ranks write nothing."""
    state = 12 * on_rank  # fp32 master, exp_avg, exp_avg_sq
    bucket = 12 * min(on_rank, max(DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_DP * dp))
    # A rank's own slices are made one bucket at a time (megatron-core 0.19.2 distrib_optimizer.py:1340,
    # inside the loop over buckets): 1/DP of a bucket, not of the shard. The CPU measurements had one
    # bucket, where the two are the same.
    own = bucket / dp
    rank0 = state + own + bucket
    other = own if memory_efficient else rank0
    zeros = min(tp, gpus_per_node)
    held = state + weight_bytes * on_rank if background else 0.0
    return SaveHost(rank0, other, zeros * rank0 + (gpus_per_node - zeros) * other, state + own, held, zeros * held,
                    written_node=zeros * (state + weight_bytes * on_rank), gathered_node=zeros * state * (dp - 1) / dp)
