"""The mixture-of-experts terms of the memory plan (memory_plan.py) beyond the parameter counts
(plan_params.py) and the expert groups' communicators (layout.communicators). Sources are megatron-core
0.19.2 as installed (megatron/core/...).

Optimizer state: megatron builds a second optimizer for the expert parameters, distributed over its own
expert-data-parallel group (optimizer/__init__.py:1206-1214, ``intra_expt_dp_group``) of world / (TP x EP
x PP) ranks, DP / EP without CP (experts do not use CP); the dense state stays distributed over DP.

Activations, per layer and micro-batch of T tokens on a rank (sequence parallel over TP): megatron's
estimate at the MLP width a token goes through (top-k x moe_intermediate_size, plan_params.active_ffn),
plus what that estimate has no term for: the dispatched copies the experts keep as their input, T x k x
hidden x 2 B (a token's k copies, gathered over the expert TP before the experts run, so not divided by
TP: transformer/moe/experts.py:1353, each expert's fc1 keeps its split of one tensor), and the router's
fp32 logits and scores, [T/TP, experts] each.

The dispatcher's buffers, one layer's at a time (its forward, or its recomputation and backward), all
assumed live at once, with routing balanced over the EP ranks (transformer/moe/token_dispatcher.py):
  alltoall: the permuted copy of the rank's T/TP x k token copies (:665) and the all-to-all's output,
    as many (:698): 2 x T/TP x k x hidden x 2 B; with TP > 1 also the copy gathered over the expert TP
    (:739) and the fp32 copy the combine reduce-scatters (:822), T x k x hidden x (2 + 4) B.
  allgather: the hidden states gathered over TP x EP into megatron's global buffer (:296), with the
    routing probabilities and map (:287, :293): T x EP x (hidden x 2 + experts x (4 + 1)) B; the
    combine's unpermuted output and the fp32 copy it reduce-scatters (:343, :362), T x EP x hidden x
    (2 + 4) B.

A checkpoint save gathers the dense state over DP and the expert state over expert DP (the expert
optimizer's own data_parallel_group, optimizer/distrib_optimizer.py:1294-1300): two gathers, each
save_memory.save_host's, whose DP-rank-0 ranks are the first TP, and the first TP x EP, of a stage.

Rollout: the engine holds every expert at rollout TP (vLLM's fused MoE splits each expert's MLP over
TP). vLLM's own expert parallelism is not modelled, and the decode model reads every expert each step
(a step over hundreds of sequences, each to its top k, reaches nearly all of them).
"""

from __future__ import annotations

import dataclasses

from megatron_dapo.config import MoEConfig, ParallelConfig
from megatron_dapo.plan_params import Experts, Shard
from megatron_dapo.save_memory import SaveHost, save_host


def token_dispatcher(moe: MoEConfig, parallel: ParallelConfig, hf: dict, on_gpu: bool) -> str:
    """megatron's token dispatcher of this run (mcore/model.moe_fields resolves moe.token_dispatcher=auto)."""
    from megatron_dapo.mcore.model import hf_arch, moe_fields

    return moe_fields(hf_arch(hf), moe, parallel, on_gpu)["moe_token_dispatcher_type"]


def expert_data_parallel(world_size: int, tp: int, pp: int, ep: int) -> int:
    """Ranks an expert's optimizer state is distributed over: world / (TP x EP x PP) (module docstring)."""
    return max(1, world_size // (tp * ep * pp))


def saved_per_layer(moe: Experts, hidden: int, tokens: int, tp: int) -> float:
    """Bytes an MoE layer keeps beyond megatron's estimate at the active width (module docstring)."""
    return tokens * moe.topk * hidden * 2 + 2 * tokens * moe.count * 4 / tp


def dispatcher_bytes(kind: str, moe: Experts, hidden: int, tokens: int, tp: int, ep: int) -> float:
    """One layer's dispatcher buffers on a rank, for ``kind`` alltoall or allgather (module docstring)."""
    copies = tokens * moe.topk * hidden  # every token's k copies over the expert TP group
    if kind == "alltoall":
        return 2 * copies / tp * 2 + (copies * (2 + 4) if tp > 1 else 0.0)
    gathered = tokens * ep
    return gathered * (hidden * 2 + moe.count * (4 + 1)) + gathered * hidden * (2 + 4)


def save(shard: Shard, *, tp: int, dp: int, ep: int, edp: int, **kw) -> SaveHost:
    """A save's host memory: the dense state's gather over DP plus the experts' over expert DP, field by
    field (save_memory.save_host takes ``kw``). The node line is the first node's, which holds the
    DP-rank-0 ranks of both. With EP > 1 the other ranks include expert-DP-rank-0 ones (the first TP x EP
    of a stage, DP rank 0 among them): "the others" is theirs, the most a rank but DP rank 0 holds."""
    dense = save_host(shard.on_rank - shard.experts_on_rank, tp=tp, dp=dp, **kw)
    if not shard.experts_on_rank:
        return dense
    experts = save_host(shard.experts_on_rank, tp=tp * ep, dp=edp, **kw)
    summed = SaveHost(*(a + b for a, b in zip(dataclasses.astuple(dense), dataclasses.astuple(experts))))
    return dataclasses.replace(summed, other=dense.other + (experts.dp_rank0 if ep > 1 else experts.other))


def note(moe: Experts, shard: Shard, *, ep: int, edp: int | None, dispatcher: str, rollout_tp: int | None) -> str:
    """The plan's line of what it assumed for the experts (``edp``: None without the distributed optimizer)."""
    engine = (f"; the engine holds every expert at rollout TP {rollout_tp} (vLLM's expert parallelism is not "
              "modelled)" if rollout_tp else "")
    state = f", their master weights and m, v over expert DP {edp}" if edp else ""
    return (f"  experts: {moe.count} per layer, top-{moe.topk}, EP {ep}: {shard.experts_on_rank / 1e9:.2f}B of the "
            f"rank's {shard.on_rank / 1e9:.2f}B parameters{state}; "
            f"{dispatcher} dispatcher, routing assumed balanced; FLOPs at the {shard.active / 1e9:.2f}B active of "
            f"{shard.total / 1e9:.2f}B parameters{engine}")
