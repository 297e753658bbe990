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
layer's tokens sequence-major ([s x b, k]); under context parallelism a CP rank routes its positions
(cut as the tokens are) and, under sequence parallelism, a TP rank its contiguous slice of them.
Positions without an engine route (a response's last token, never fed to the engine; padding) replay
experts spread over all (``replay``): their outputs reach no log-prob, but a response's last token is
a real token, so its experts count in the load-balancing loss. Megatron replays again in a
recomputed backward from a list the 1F1B order does not keep in step: R3 refuses recompute
(config_rules).
"""

from __future__ import annotations

import contextlib
import weakref
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
    without the router's per-micro-batch losses. Under a padding mask megatron divides them by the real
    tokens, zero there: 0 / 0 would make the router's gradient NaN. The TP ranks of a micro-batch agree
    (same data), so the losses' own TP reduction is skipped by all of them alike."""
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    if off:
        # the global load-balancing loss stays: it all-reduces its token counts over DP inside the forward
        # (every DP rank must join), and a slot that is padding here is real on the busiest rank (0 < total)
        if config.moe_router_load_balancing_type != "global_aux_loss":
            config.moe_aux_loss_coeff = 0.0
        config.moe_z_loss_coeff = None
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


def moe_metrics(config, real_microbatches: int, microbatches: int, device) -> dict[str, torch.Tensor]:
    """``router_losses`` and, under R3, moe/route_agreement: the fraction of (token, layer) pairs whose
    replayed experts the trainer's router would have chosen itself, over the update's forwards (a TP rank
    counts its sequence-parallel slice, a CP rank its positions: summed over TP x CP, PP and DP). Collective
    over TP x CP, PP and DP."""
    from megatron.core import parallel_state as ps

    out = router_losses(config, real_microbatches, microbatches, device)
    if config.moe_enable_routing_replay:
        counts = AGREEMENT.take(device)
        for group in (ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group(),
                      ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
        out["moe/route_agreement"] = (counts[0] / counts[1].clamp(min=1)).float().cpu()
    return out


def router_losses(config, real_microbatches: int, microbatches: int, device) -> dict[str, torch.Tensor]:
    """The update's router losses before their coefficients, each the mean over the model's layers and the
    micro-batches with a real token of every DP rank (``real_microbatches``: this rank's); the tracker is
    cleared for the next schedule. Under sequence parallelism a TP rank's load-balancing loss is its
    slice's share (summed over TP, as megatron's own report does) and its z-loss a mean over its slice
    (averaged over TP); under context parallelism a CP rank's likewise over its positions (TP x CP). The
    global load-balancing loss is one loss per slot of the schedule shared over TP x DP x CP (router.py
    ``_apply_global_aux_loss``): summed over them, then the mean over the ``microbatches`` slots (as many
    on every DP rank), micro-batches of padding only included. Collective over TP x CP, PP and DP (every
    rank of them calls it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    names = logged_router_losses(config)
    sums = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)  # + real micro-batches, slots
    for i, name in enumerate(names):
        for kind in TRACKED[name]:
            if (entry := tracker.metrics.get(kind)) is not None:
                sums[i] += entry.values.detach().double().sum().to(device)
    tracker.clear()
    # a TP rank routes its sequence-parallel slice and a CP rank its positions: megatron reduces the
    # router's token counts over TP x CP, and so do these sums
    tp, pp, dp = (ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group(),
                  ps.get_data_parallel_group())
    if dist.get_world_size(tp) > 1:
        dist.all_reduce(sums, group=tp)
        sums[:len(names)] /= torch.tensor([1.0 if n == "moe/load_balancing_loss" else dist.get_world_size(tp)
                                           for n in names], dtype=torch.float64, device=device)
    # a rank holds its stage's layers: sum the stages (each adds 1 / PP of its micro-batch count) and DP
    # (the real micro-batches of every rank; the slots, as many on each DP rank, once)
    stages = max(dist.get_world_size(pp), 1)
    sums[-2] += real_microbatches / stages
    sums[-1] += microbatches / (stages * max(dist.get_world_size(dp), 1))
    for group in (pp, dp):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
    shared = config.moe_router_load_balancing_type == "global_aux_loss"
    count = torch.stack([sums[-1] if shared and n == "moe/load_balancing_loss" else sums[-2] for n in names]) \
        if names else sums[:0]
    per = sums[:len(names)] / (config.num_layers * count.clamp(min=1))
    return {name: per[i].float().cpu() for i, name in enumerate(names)}


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> its replaying routers


def routers(chunk) -> list:
    """The TopKRouters of a model chunk that replay routes (megatron builds them with a RouterReplay
    when moe_enable_routing_replay is set); found once per chunk, not on every micro-batch."""
    if chunk not in _ROUTERS:
        _ROUTERS[chunk] = [m for m in chunk.modules() if getattr(m, "router_replay", None) is not None]
    return _ROUTERS[chunk]


class RouteAgreement:
    """Over an update's forwards: the tokens whose replayed experts are the ones the trainer's router
    would choose itself (same set), and the tokens replayed; only tokens with an engine route count."""

    def __init__(self):
        self.counts: torch.Tensor | None = None  # [agree, total] on the device: no host sync per router

    def count(self, router, args, kwargs, output) -> None:
        target = router.router_replay.target_topk_idx
        if target is None:
            return
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
            own = torch.topk(logits, router.topk, dim=-1).indices.sort(-1).values
            same = (own == target.to(own.device).sort(-1).values).all(-1)
            valid = router.r3_known.to(same.device)  # tokens with an engine route (replay)
            step = torch.stack([(same & valid).sum(), valid.sum()]).double()
            self.counts = step if self.counts is None else self.counts + step.to(self.counts.device)

    def take(self, device=None) -> torch.Tensor:
        """The counts so far ([agree, total] float64) and a fresh start."""
        counts = torch.zeros(2, dtype=torch.float64) if self.counts is None else self.counts
        self.counts = None
        return counts if device is None else counts.to(device)


AGREEMENT = RouteAgreement()


def install_replay(chunks) -> None:
    """Count every replaying router's agreement (AGREEMENT); once per built model."""
    for chunk in chunks:
        for router in routers(chunk):
            router.register_forward_hook(AGREEMENT.count, with_kwargs=True)


def replay(chunk, routes: torch.Tensor | None, shape: tuple[int, int], *, has_samples: bool = True,
           token_index: torch.Tensor | None = None) -> None:
    """Give each replaying router of ``chunk`` its layer's experts of a micro-batch of ``shape`` [b, s]:
    ``routes`` [b, s, layers x k] (batching.MicroBatch.routed_experts, -1 where none; None for a micro-batch
    of padding only, ``has_samples`` False) for REPLAY_FORWARD. Positions without a route replay experts
    spread over all (token t: t x k .. t x k + k - 1, mod E), so that padding loads no EP rank alone.
    ``token_index`` [b, s]: each position's t, its number in the whole micro-batch (position x rows + row)
    when the rank holds some of its positions (context parallelism: ``filler_index``); None: all of them.
    A padded row's filler is then the same at any CP, and so are the load-balancing loss's counts (a
    packed row's samples sit at offsets that CP's slot rounding moves, and their fillers with them)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    chunk_routers = routers(chunk)
    if not chunk_routers:
        return
    if routes is None and has_samples:
        raise ValueError("moe.router_replay=R3 but the micro-batch's samples carry no routed experts (the "
                         "engine returned none)")
    config, k = chunk_routers[0].config, chunk_routers[0].topk
    b, s = shape
    if routes is not None and routes.shape[2] != config.num_layers * k:
        raise ValueError(f"routed experts of width {routes.shape[2]} for {config.num_layers} layers x top-{k}")
    tokens = filler_index(b, s) if token_index is None else token_index
    filler = (tokens.transpose(0, 1)[..., None] * k + torch.arange(k)) % config.num_moe_experts  # [s, b, k]
    tp = ps.get_tensor_model_parallel_world_size()
    rows = slice(None)
    if config.sequence_parallel and tp > 1:  # this TP rank routes its contiguous s / TP positions
        per = s // tp
        rows = slice(ps.get_tensor_model_parallel_rank() * per, (ps.get_tensor_model_parallel_rank() + 1) * per)
    for router in chunk_routers:
        layer = router.layer_number - 1
        idx = filler if routes is None else routes[:, :, layer * k:(layer + 1) * k].transpose(0, 1)  # [s, b, k]
        known = (idx[..., 0] >= 0) if routes is not None else torch.zeros(s, b, dtype=torch.bool)
        idx, known = torch.where(known[..., None], idx, filler)[rows], known[rows]
        router.r3_known = known.reshape(-1)  # for RouteAgreement
        router.router_replay.set_target_indices(idx.reshape(-1, k).contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def filler_index(b: int, s: int) -> torch.Tensor:
    """[b, s] long: each position's number in a [b, s] micro-batch, position-major (``replay``'s t)."""
    return torch.arange(s * b).view(s, b).transpose(0, 1)


def stage_padding_mask(chunk, mask: torch.Tensor) -> torch.Tensor:
    """GPTModel's ``padding_mask`` [b, s] as ``chunk`` needs it: the first stage scatters it over the
    sequence-parallel ranks itself (gpt_model.py), a later stage gets hidden states already scattered and
    needs this TP rank's contiguous s / TP columns."""
    from megatron.core import parallel_state as ps

    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    tp = ps.get_tensor_model_parallel_world_size()
    if not inner.config.sequence_parallel or tp == 1 or inner.pre_process:
        return mask
    per = mask.shape[1] // tp
    rank = ps.get_tensor_model_parallel_rank()
    return mask[:, rank * per:(rank + 1) * per]


def clear_replay(chunks) -> None:
    """Forget a schedule's routes (RouterReplay keeps every micro-batch's for a recomputed backward)."""
    for chunk in chunks:
        for router in routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
