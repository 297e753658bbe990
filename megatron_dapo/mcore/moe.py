"""What the trainer tells and reads from megatron-core's mixture-of-experts layers: rollout routing
replay (R3) and, as metrics, the router's auxiliary losses and how often its own choice agrees with the
replayed one.

Losses: megatron's router records each MoE layer's load-balancing loss (and z-loss) divided by its
coefficient in a process-wide tracker (``moe_logging.MoEMetricsTracker``), summed over the
micro-batches of a schedule: a rank holds the entries of its own pipeline stage's layers.

Replay (moe.router_replay=R3): with ``moe_enable_routing_replay`` every TopKRouter has a
``RouterReplay``; before a micro-batch's forward each router of the rank gets the engine's experts of
its layer for the micro-batch's tokens and the REPLAY_FORWARD action: it routes to those experts, its
gate weights a softmax of its own logits over them (so the router still learns). Megatron orders a
layer's tokens sequence-major ([s x b, k]) and, under sequence parallelism, a TP rank routes its
contiguous s / TP slice. Positions without an engine route (a response's last token, never fed to the
engine; padding) replay experts 0..k-1: their outputs reach no loss. Megatron replays again in a
recomputed backward from a list the 1F1B order does not keep in step: R3 refuses recompute
(config_rules).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist

class TokenOutputs(NamedTuple):
    """A last stage's forward output, (log_probs, entropy) [b, s] fp32 each, as the schedule sees it: for an
    MoE model megatron's schedule asks the output for its ``device`` to scale the router's losses
    (schedules.get_tensor_device), which a plain tuple has not."""

    log_probs: torch.Tensor
    entropy: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.log_probs.device


# our metric -> the tracker's names it sums (one load-balancing kind is on at a time)
TRACKED = {"moe/load_balancing_loss": ("load_balancing_loss", "seq_load_balancing_loss",
                                       "global_load_balancing_loss"),
           "moe/z_loss": ("z_loss",)}


@contextlib.contextmanager
def without_router_losses(config, off: bool):
    """``off``: a micro-batch with no real token (one that evens out the DP ranks' micro-batch counts) runs
    without the router's losses. Under a padding mask megatron divides them by the real tokens, zero
    there: 0 / 0 would make the router's gradient NaN. The TP ranks of a micro-batch agree (same data),
    so the losses' own TP reduction is skipped by all of them alike."""
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    if off:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def logged_router_losses(config) -> list[str]:
    """The metrics ``router_losses`` gives for a megatron TransformerConfig: those it turns on."""
    names = []
    if config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff:
        names.append("moe/load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("moe/z_loss")
    return names


def moe_metrics(config, num_microbatches: int, device) -> dict[str, torch.Tensor]:
    """``router_losses`` and, under R3, moe/route_agreement: the fraction of (token, layer) pairs whose
    replayed experts the trainer's router would have chosen itself, over the update's forwards."""
    out = router_losses(config, num_microbatches, device)
    if config.moe_enable_routing_replay:
        from megatron.core import parallel_state as ps

        counts = torch.tensor(AGREEMENT.take(), dtype=torch.float64, device=device)
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
        out["moe/route_agreement"] = (counts[0] / counts[1].clamp(min=1)).float().cpu()
    return out


def router_losses(config, num_microbatches: int, device) -> dict[str, torch.Tensor]:
    """The update's router losses before their coefficients, each the mean over the model's layers,
    the micro-batches with a real token (``num_microbatches``) and the data-parallel ranks; the tracker
    is cleared for the next schedule.
    Collective over the pipeline and data-parallel groups (every rank of them calls it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    names = logged_router_losses(config)
    sums = torch.zeros(len(names), dtype=torch.float32, device=device)
    for i, name in enumerate(names):
        for kind in TRACKED[name]:
            if (entry := tracker.metrics.get(kind)) is not None:
                sums[i] += entry.values.detach().float().sum().to(device)
    tracker.clear()
    # a rank holds its stage's layers: sum the stages; the DP ranks' micro-batches differ: average them
    for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
    sums /= config.num_layers * max(num_microbatches, 1) * dist.get_world_size(ps.get_data_parallel_group())
    return {name: sums[i].cpu() for i, name in enumerate(names)}


def routers(chunk) -> list:
    """The TopKRouters of a model chunk that replay routes (megatron builds them with a RouterReplay
    when moe_enable_routing_replay is set)."""
    return [m for m in chunk.modules() if getattr(m, "router_replay", None) is not None]


class RouteAgreement:
    """Over an update's forwards: the tokens whose replayed experts are the ones the trainer's router
    would choose itself (same set), and the tokens replayed; only tokens with an engine route count."""

    def __init__(self):
        self.agree, self.total = 0.0, 0.0

    def count(self, router, args, kwargs, output) -> None:
        target = router.router_replay.target_topk_idx
        if target is None:
            return
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
            own = torch.topk(logits, router.topk, dim=-1).indices.sort(-1).values
            same = (own == target.to(own.device).sort(-1).values).all(-1)
            valid = router.r3_known.to(same.device)  # tokens with an engine route (replay)
            self.agree += float((same & valid).sum())
            self.total += float(valid.sum())

    def take(self) -> tuple[float, float]:
        counts, (self.agree, self.total) = (self.agree, self.total), (0.0, 0.0)
        return counts


AGREEMENT = RouteAgreement()


def install_replay(chunks) -> None:
    """Count every replaying router's agreement (AGREEMENT); once per built model."""
    for chunk in chunks:
        for router in routers(chunk):
            router.register_forward_hook(AGREEMENT.count, with_kwargs=True)


def replay(chunk, routes: torch.Tensor | None) -> None:
    """Give each replaying router of ``chunk`` its layer's experts of a micro-batch: ``routes`` [b, s,
    layers x k] (batching.MicroBatch.routed_experts, -1 where none) for REPLAY_FORWARD."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    chunk_routers = routers(chunk)
    if not chunk_routers:
        return
    if routes is None:
        raise ValueError("moe.router_replay=R3 but the micro-batch's samples carry no routed experts (the "
                         "engine returned none)")
    k = chunk_routers[0].topk
    b, s, width = routes.shape
    if width != chunk_routers[0].config.num_layers * k:
        raise ValueError(f"routed experts of width {width} for {chunk_routers[0].config.num_layers} layers x top-{k}")
    filler = torch.arange(k).expand(b, s, k)
    tp, sp = ps.get_tensor_model_parallel_world_size(), chunk_routers[0].config.sequence_parallel
    for router in chunk_routers:
        layer = router.layer_number - 1
        idx = routes[:, :, layer * k:(layer + 1) * k].transpose(0, 1)  # [s, b, k]: megatron's token order
        if sp and tp > 1:
            rank, per = ps.get_tensor_model_parallel_rank(), s // tp
            idx = idx[rank * per:(rank + 1) * per]
        known = idx[..., 0] >= 0
        router.r3_known = known.reshape(-1)  # for RouteAgreement
        idx = torch.where(known[..., None], idx, filler.transpose(0, 1)[:idx.shape[0]])
        router.router_replay.set_target_indices(idx.reshape(-1, k).contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(chunks) -> None:
    """Forget a schedule's routes (RouterReplay keeps every micro-batch's for a recomputed backward)."""
    for chunk in chunks:
        for router in routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
