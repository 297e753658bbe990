"""Per-GPU memory of a layout, itemised by phase, before anything launches (``megatron-dapo plan``).

Sizes are bytes on the most loaded rank. Trainer state, per parameter of the first pipeline stage's
shard (embedding and the most micro-batches in flight; plan_params.py counts them): weights 2 B (bf16)
or 4 B (fp32); gradients 4 B (megatron DDP's main gradients are fp32); an fp32 master copy (4 B, bf16
only) and Adam's m and v (8 B), both divided over DP with the distributed optimizer. That is 18 B /
parameter in bf16 without it, 6 + 12 / DP with it (megatron's theoretical_memory_usage.py;
tests/unit/test_plan.py); an expert's master copy and m, v divide over expert DP instead (moe_plan.py,
with the rest a mixture-of-experts model adds). The master copy and the gradient buffers exist once the
actor is built; m and v at the first update, after vLLM's start-up free-memory check (on a resume at
load, before it); with offload the state is off the device when the engine is built (run.py).

Per process, outside every allocator: one CUDA context (trainer and the in-process vLLM share it)
and an NCCL communicator's buffers for every process group that has run a collective (trainer and
vLLM groups, ``communicators``). Constants and their sources: gpu_models.py, docs/memory_plan.md.

Activations per micro-batch of ``train.max_tokens_per_micro_batch`` tokens, per layer (bf16):
megatron's selective-recompute estimate T x h x (18 + 4 ffn / h) / TP (sequence parallel; ffn: the MLP
width a token goes through), T being a rank's share under context parallelism (T / CP, as for the
output layer below; the optimizer state then shards over DP x CP); with full recompute a layer keeps
its input, T x h x 2 / TP, and one layer is rebuilt at a time. The first stage holds PP micro-batches
in flight (1F1B), the last one. The output layer (last stage) adds logprobs.py's chunk buffers
([chunk, V_local]: the logits in the weight's dtype and two fp32 work buffers) and, with the gradient
hint, its early gradients kept from forward to backward: [N, H] for the hidden states (activation
dtype), [V_local, H] fp32 for the weight, and the [N, H] reordered copy of the hidden states the
forward makes (N = tokens of the micro-batch).

The colocated vLLM engine takes rollout.gpu_memory_utilization x the total CUDA reports (weights at
rollout TP, its profile's activation peak, the KV cache) while it generates; asleep it leaves a
residue. With actor.offload_during_rollout the gradients, master weights and m, v leave the device
while it generates (actor.offload_weights: the weights too). A layout must fit both phases.

``plan_checks.check_fits`` names the fix: a smaller vLLM share only while one still holds the engine's weights,
its activations and the KV cache of one sequence (``Plan.engine_floor``; below that vLLM refuses to
start), else what would make room for those: the offload, a trainer spread over more GPUs, a larger
rollout TP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from megatron_dapo import generation_model as gm
from megatron_dapo import moe_plan
from megatron_dapo.config import ActorConfig, DAPOConfig, ModelConfig, ParallelConfig, RolloutConfig
from megatron_dapo.layout import Communicator, communicators
from megatron_dapo.plan_params import Experts, Shard, active_ffn, count_parameters, experts
from megatron_dapo.save_memory import SaveHost, save_seconds
from megatron_dapo.gpu_models import CUDA_CONTEXT_BYTES, GPUModel, gpu_model

GB = 1e9
# What a sleeping engine keeps besides the context and its communicators: counted whole, as
# measured for a whole process after sleep (docs/memory_plan.md), so it overlaps them a little.
SLEEP_RESIDUE_BYTES = 1.0 * GB
VLLM_VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this (vocab_parallel_embedding.py)


@dataclass(frozen=True)
class Item:
    """One line of the plan. generating: resident while vLLM generates; training: on which rank of
    the training phase it sits ("all", "first" stage, "last" stage, "none"); counted=False: shown only."""

    key: str
    label: str
    bytes: float
    generating: bool
    training: Literal["all", "first", "last", "none"]
    counted: bool = True


@dataclass(frozen=True)
class RolloutPlan:
    """The engine's side, per GPU (bytes) unless named per replica.

    share: utilization x reported total; weights, activations: the engine's shard and profile peak;
    kv: its KV cache at the configured utilization (share - weights - activations); room: the largest
    KV cache that fits beside everything else resident while generating, without offload; offload:
    what the offload setting (on, or offload_during_rollout=true when off) moves out while generating.
    """

    replicas: int
    tensor_parallel: int
    share: float
    weights: float
    activations: float
    kv: float
    room: float
    offload: float
    kv_bytes_per_token: int  # the whole model's, one token
    kv_bytes_per_token_per_gpu: float
    max_sequence: int  # data.max_prompt_length + rollout.max_response_length

    def tokens(self, bytes_per_gpu: float) -> float:
        """Tokens per replica that ``bytes_per_gpu`` of KV cache on each of its GPUs hold."""
        return max(0.0, bytes_per_gpu) / self.kv_bytes_per_token_per_gpu


@dataclass(frozen=True)
class Plan:
    """A layout's plan on one GPU model: its items (bytes on the most loaded rank), the engine's side,
    the generation estimates, the step time (s) and tokens per step, and the pinned host memory."""

    items: list[Item]
    gpu: GPUModel
    pp: int
    rollout: RolloutPlan | None  # None: not the vLLM engine
    generation: gm.GenerationTime
    tokens_per_step: float
    step_s: float
    host_sleep_per_rank: float  # pinned host bytes sleep level 1 keeps (0 at level 2)
    host_offload_per_rank: float  # pinned host bytes the offload copies into (0 when off)
    host_offload_if_on: float  # the same, had the offload been on
    gpus_per_node: int
    offload_on: bool
    save: SaveHost | None = None  # None: without the distributed optimizer
    notes: list[str] = dataclasses.field(default_factory=list)
    shard: Shard | None = None  # the trainer's parameter counts
    world_size: int = 1  # the trainers' ranks planned

    @property
    def parts(self) -> dict[str, float]:
        return {i.key: i.bytes for i in self.items}

    @property
    def stop_lead_s(self) -> float | None:
        """The warning a stop signal must give (SLURM's --signal=USR1@LEAD) when it comes as a step's
        generation ends: the step's log-probs and updates and a save still fit. Earlier, the stop cuts
        the generation short (train.py). None without the distributed optimizer (no save model)."""
        return None if self.save is None else self.step_s - self.generation.seconds + save_seconds(self.save)

    @property
    def capacity_bytes(self) -> float:
        return float(self.gpu.reported_bytes)

    @property
    def capacity_gb(self) -> float:
        return self.capacity_bytes / GB

    @property
    def state(self) -> float:
        """The trainer's resident state: weights, gradients, master weights, Adam m and v."""
        return sum(self.parts.get(k, 0.0) for k in ("weights", "gradients", "master", "adam"))

    @property
    def generating_bytes(self) -> float:
        return sum(i.bytes for i in self.items if i.counted and i.generating)

    def training_bytes_on(self, stage: Literal["first", "last"]) -> float:
        """The training peak of the first or last pipeline stage (the same rank when PP is 1)."""
        stages = {"all", "first", "last"} if self.pp == 1 else {"all", stage}
        return sum(i.bytes for i in self.items if i.counted and i.training in stages)

    @property
    def training_bytes(self) -> float:
        return max(self.training_bytes_on("first"), self.training_bytes_on("last"))

    @property
    def generating_gb(self) -> float:
        return self.generating_bytes / GB

    @property
    def training_gb(self) -> float:
        return self.training_bytes / GB

    def resident_at_build(self, *, resume: bool) -> float:
        """Device bytes the trainer holds when vLLM's start-up check runs (run.py builds the engine
        after the actor, and with offload on offloads first): the context, the communicators and the
        state not offloaded; Adam's m and v only on a resume (a fresh run makes them at its first
        update, after the check)."""
        keys = ("context", "nccl_trainer", "nccl_vllm", "weights", "gradients", "master",
                *(("adam",) if resume else ()))
        return sum(i.bytes for i in self.items if i.key in keys and i.generating)

    @property
    def startup_spare_bytes(self) -> float:
        """Free bytes beyond vLLM's request at its start-up check, on a fresh run."""
        share = self.rollout.share if self.rollout else 0.0
        return self.capacity_bytes - self.resident_at_build(resume=False) - share

    @property
    def engine_floor(self) -> float:
        """The least vLLM's share can be per GPU (bytes): its weights, its profile's activations and the
        KV cache of one sequence of data.max_prompt_length + rollout.max_response_length, below which
        vLLM refuses to start. Needs the colocated vLLM engine (``rollout``)."""
        r = self.rollout
        return r.weights + r.activations + r.max_sequence * r.kv_bytes_per_token_per_gpu

    @property
    def least_utilization(self) -> float:
        """The smallest rollout.gpu_memory_utilization that holds ``engine_floor`` (two decimals, up)."""
        return math.ceil(100 * self.engine_floor / self.capacity_bytes) / 100

    def beside_engine(self, *, offload: bool, offload_weights: bool) -> float:
        """Bytes the trainer keeps on each GPU while vLLM generates under these offload settings,
        whatever the configuration says: the context, the communicators and the state not moved."""
        parts = self.parts
        fixed = sum(parts.get(k, 0.0) for k in ("context", "nccl_trainer", "nccl_vllm"))
        moved_with_offload = parts["gradients"] + parts.get("master", 0.0) + parts["adam"]
        return (fixed + (0.0 if offload and offload_weights else parts["weights"])
                + (0.0 if offload else moved_with_offload))

    def max_utilization(self, offload: bool) -> float:
        """The largest rollout.gpu_memory_utilization that fits while generating (two decimals, down),
        with the offload (``offload``) or without it, whatever the configuration says."""
        others = self.generating_bytes - (self.rollout.share if self.rollout else 0.0)
        moved = self.rollout.offload if self.rollout else 0.0
        if offload != self.offload_on:
            others += -moved if offload else moved
        return math.floor(100 * (self.capacity_bytes - others) / self.capacity_bytes) / 100


def _activations(model: ModelConfig, parallel: ParallelConfig, hf: dict, tokens: int, in_flight: int) -> float:
    """Bytes a stage keeps for ``in_flight`` micro-batches of ``tokens`` tokens (module docstring)."""
    p, moe = parallel, experts(hf)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, f = hf["hidden_size"], active_ffn(hf)
    per_layer = tokens * h * (18 + 4 * f / h) / tp  # megatron's estimate (selective recompute, SP)
    if moe:
        per_layer += moe_plan.saved_per_layer(moe, h, tokens, tp)
    layers = hf["num_hidden_layers"] // pp
    if model.recompute == "full":
        return in_flight * (layers * tokens * h * 2 / tp) + per_layer
    return in_flight * layers * per_layer


def _output_layer(hf: dict, tokens: int, v_local: int, weight_bytes: int,
                  chunk_tokens: int = 0) -> tuple[float, float, int]:
    """(chunk buffer bytes, early-gradient bytes, chunk tokens) of logprobs.py's fused output layer
    on a [tokens, H] micro-batch with a [V_local, H] weight shard (module docstring);
    ``chunk_tokens``: train.logprob_chunk_tokens (0: logprobs.py's default rule; set, it has no byte cap)."""
    from megatron_dapo.mcore.logprob_chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_TOKENS

    chunk = min(chunk_tokens or max(1, min(DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_BYTES // (4 * v_local))), tokens)
    buffers = chunk * v_local * (weight_bytes + 2 * 4)
    h = hf["hidden_size"]
    early = 2 * tokens * h * weight_bytes + v_local * h * 4 + tokens * 4  # grad, reordered copy; weight grad
    return float(buffers), float(early), chunk


@dataclass(frozen=True)
class _Layout:
    """What the item builders share: the rank's shard and the sizes derived from the config."""

    shard: Shard
    tp: int
    pp: int
    dp: int
    padded_vocab: int
    weight_bytes: int  # 2 (bf16) or 4 (fp32)
    tokens: int  # per micro-batch
    sequence: int  # data.max_prompt_length + rollout.max_response_length
    ep: int = 1
    edp: int = 1  # expert DP: the ranks an expert's optimizer state is distributed over
    experts: Experts | None = None  # None: a dense model
    dispatcher: str = ""  # megatron's token dispatcher (an MoE model's)
    cp: int = 1  # context parallel: each rank holds 1 / CP of every sequence's positions

    @property
    def rank_tokens(self) -> int:
        """The positions of a micro-batch one rank computes: its CP share (mcore/context_parallel.py)."""
        return -(-self.tokens // self.cp)

    @property
    def state_dp(self) -> int:
        """The ranks the distributed optimizer shards the dense state over: DP x CP (megatron's
        intra_dp_cp group; the CP ranks of a replica hold the same parameters)."""
        return self.dp * self.cp


def _trainer_items(cfg: DAPOConfig, hf: dict, lay: _Layout, comms: list[Communicator],
                   on_gpu: bool) -> list[Item]:
    """The context, the communicators and everything the trainer holds (module docstring)."""
    p, on_rank, off = cfg.parallel, lay.shard.on_rank, cfg.actor.offload_during_rollout
    dist = p.use_distributed_optimizer
    dense, routed = on_rank - lay.shard.experts_on_rank, lay.shard.experts_on_rank
    # the parameters whose optimizer state the rank keeps: the dense ones' 1/DP, the experts' 1/expert DP
    sharded = dense / (lay.state_dp if dist else 1) + routed / (lay.edp if dist else 1)
    over = f"DP {lay.dp}" if lay.cp == 1 else f"DP x CP {lay.dp} x {lay.cp}"
    where = f"distributed over {over}" if dist else "not distributed"
    if dist and lay.experts:
        where = f"distributed: dense over {over}, experts over expert DP {lay.edp}"
    moved = "; off the GPU while generating"
    cp_share = f", {lay.rank_tokens} of them on this CP rank" if lay.cp > 1 else ""

    def nccl(owner: str) -> Item:
        mine = [c for c in comms if c.owner == owner]
        names = ", ".join(f"{c.name} {c.ranks}" for c in mine)
        return Item(f"nccl_{owner.lower()}", f"NCCL buffers, {owner} groups ({names})",
                    sum(c.bytes for c in mine), True, "all")

    items = [
        Item("context", "CUDA context (one per process; vLLM runs in the trainer's)",
             CUDA_CONTEXT_BYTES if on_gpu else 0.0, True, "all"),
        nccl("trainer"), nccl("vLLM"),
        Item("weights", f"weights ({'bf16' if lay.weight_bytes == 2 else 'fp32'}, {on_rank / 1e9:.2f}B "
             f"params on this rank{moved if cfg.actor.offload_weights else ''})", on_rank * lay.weight_bytes,
             not cfg.actor.offload_weights, "all"),
        Item("gradients", f"gradients (fp32{moved if off else ''})", on_rank * 4, not off, "all"),
    ]
    if lay.weight_bytes == 2:
        items.append(Item("master", f"fp32 master weights ({where}{moved if off else ''})",
                          sharded * 4, not off, "all"))
    other = "without" if p.use_distributed_optimizer else "with"
    optimizer_bytes = 8 + (4 if lay.weight_bytes == 2 else 0)
    items += [
        Item("adam", f"Adam m, v ({where}; allocated at the first update{moved if off else ''})",
             sharded * 8, not off, "all"),
        Item("optimizer_other", f"(master + m, v {other} the distributed optimizer)",
             optimizer_bytes * (on_rank if dist else dense / lay.state_dp + routed / lay.edp), False, "none",
             counted=False),
        Item("activations", f"activations, first stage ({lay.tokens} tokens/micro-batch{cp_share}, recompute "
             f"{cfg.model.recompute}, x{lay.pp} in flight)", _activations(cfg.model, p, hf, lay.rank_tokens, lay.pp),
             False, "first"),
    ]
    if lay.pp > 1:
        items.append(Item("activations_last", "activations, last stage (x1 in flight)",
                          _activations(cfg.model, p, hf, lay.rank_tokens, 1), False, "last"))
    if lay.experts:
        items.append(Item("moe_dispatch", f"MoE {lay.dispatcher} dispatcher buffers (one layer's; moe_plan.py)",
                          moe_plan.dispatcher_bytes(lay.dispatcher, lay.experts, hf["hidden_size"], lay.rank_tokens,
                                                    lay.tp, lay.ep), False, "all"))
    v_local = lay.padded_vocab // lay.tp
    buffers, early, chunk = _output_layer(hf, lay.rank_tokens, v_local, lay.weight_bytes,
                                          chunk_tokens=cfg.train.logprob_chunk_tokens)
    stage = "last stage, " if lay.pp > 1 else ""
    return [*items,
            Item("logprob_buffers", f"log-prob chunk buffers ({stage}[{chunk}, {v_local}] x3; logprobs.py)",
                 buffers, False, "last"),
            Item("early_grads", f"output layer's early gradients ({stage}[N, H] x2, [V_local, H] fp32; "
                 "logprobs.py)", early, False, "last")]


def _rollout(actor: ActorConfig, rollout: RolloutConfig, hf: dict, lay: _Layout, items: list[Item], device: GPUModel,
             world_size: int) -> tuple[list[Item], RolloutPlan]:
    """The engine's two items and its side of the plan (RolloutPlan)."""
    rtp = rollout.tensor_parallel_size
    vocab = -(-hf["vocab_size"] // (VLLM_VOCAB_PADDING * rtp)) * VLLM_VOCAB_PADDING * rtp
    engine_weights = count_parameters(hf, tp=rtp, pp=1, padded_vocab=vocab).on_rank * lay.weight_bytes
    activations = gm.vllm_activation_bytes(hf, rtp, dtype_bytes=lay.weight_bytes)
    if rollout.kv_cache_memory_mb:  # vLLM sizes the KV cache from it and ignores gpu_memory_utilization
        share = engine_weights + activations + (rollout.kv_cache_memory_mb << 20)
        what = f"weights + activations + rollout.kv_cache_memory_mb {rollout.kv_cache_memory_mb}"
    else:
        share = rollout.gpu_memory_utilization * device.reported_bytes
        what = f"gpu_memory_utilization {rollout.gpu_memory_utilization} x {device.reported_bytes / GB:.2f} GB"
    engine = [Item("vllm_generating", f"vLLM's share: {what}", share, True, "none"),
              Item("vllm_asleep", f"vLLM asleep (sleep level {rollout.sleep_level}: what sleep leaves)",
                   SLEEP_RESIDUE_BYTES, False, "all")]
    parts = {i.key: i.bytes for i in items}
    offload = parts["gradients"] + parts.get("master", 0.0) + parts["adam"]
    if actor.offload_weights:
        offload += parts["weights"]
    resident = sum(i.bytes for i in items if i.counted and i.generating)
    if actor.offload_during_rollout:  # the room "without offload" counts the moved state as resident
        resident += offload
    plan_ = RolloutPlan(
        replicas=world_size // rtp, tensor_parallel=rtp, share=share, weights=engine_weights,
        activations=activations, kv=share - engine_weights - activations,
        room=device.reported_bytes - resident - engine_weights - activations, offload=offload,
        kv_bytes_per_token=gm.kv_bytes_per_token(hf, dtype_bytes=lay.weight_bytes),
        kv_bytes_per_token_per_gpu=gm.kv_bytes_per_token_per_gpu(hf, rtp, dtype_bytes=lay.weight_bytes),
        max_sequence=lay.sequence)
    return engine, plan_


def plan(cfg: DAPOConfig, hf: dict, world_size: int, *, gpu: str | GPUModel = "h100",
         capacity_gb: float | None = None, mfu: float = 0.3, mean_response_fraction: float = 0.5,
         on_gpu: bool = True, gpus_per_node: int | None = None,
         decode_efficiency: float = gm.DECODE_BANDWIDTH_EFFICIENCY) -> Plan:
    """The plan of ``cfg`` at ``world_size`` on ``gpu`` (a GPU_MODELS key or a GPUModel);
    ``capacity_gb`` (1e9 bytes) replaces the model's reported total when given."""
    from megatron_dapo.mcore.model import padded_vocab_size, resolve_runtime
    from megatron_dapo.rollout.worlds import rank_counts

    device = (gpu_model(gpu) if isinstance(gpu, str) else gpu).with_capacity(capacity_gb)
    p, t, r = cfg.parallel, cfg.train, cfg.rollout
    # Separate placement: the trainers' ranks are this plan's; the engines run on GPUs of their own,
    # which are not planned (nothing of theirs sits beside the trainer's state).
    world_size, engine_ranks = rank_counts(r, world_size)
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    moe = experts(hf)
    padded = padded_vocab_size(hf["vocab_size"], cfg.model.make_vocab_size_divisible_by, tp)
    seq = cfg.data.max_prompt_length + r.max_response_length
    bf16 = resolve_runtime(cfg.model, on_gpu, check_installed=False).params_dtype.itemsize == 2
    dispatcher = moe_plan.token_dispatcher(cfg.moe, p, hf, on_gpu) if moe else ""
    lay = _Layout(count_parameters(hf, tp=tp, pp=pp, padded_vocab=padded, ep=ep), tp, pp,
                  p.data_parallel_size(world_size), padded, 2 if bf16 else 4,
                  t.max_tokens_per_micro_batch or t.micro_batch_size * seq, seq,
                  ep, moe_plan.expert_data_parallel(world_size, tp, pp, ep), moe, dispatcher,
                  cp=p.context_parallel_size)
    groups = communicators(cfg, world_size, dispatcher=dispatcher or None) if on_gpu else []
    items = _trainer_items(cfg, hf, lay, groups, on_gpu)
    rollout = None
    if r.engine == "vllm" and r.placement == "colocated":
        engine, rollout = _rollout(cfg.actor, r, hf, lay, items, device, world_size)
        items += engine

    d = cfg.data
    prompts = d.gen_prompts_per_batch if cfg.algorithm.filter_groups.enable else d.prompts_per_step
    mean_prompt, mean_response = d.max_prompt_length / 2, r.max_response_length * mean_response_fraction
    trained = cfg.data.prompts_per_step * r.n * (mean_prompt + mean_response)
    decode = None
    if rollout is not None:
        decode = gm.decode_estimate(gm.Replica(
            responses=-(-prompts * r.n // rollout.replicas), prompt_tokens=mean_prompt,
            response_tokens=mean_response, kv_tokens=rollout.tokens(rollout.kv),
            weight_bytes_per_gpu=rollout.weights,
            kv_bytes_per_token_per_gpu=rollout.kv_bytes_per_token_per_gpu,
            hbm_bytes_per_s=device.hbm_bytes_per_s, efficiency=decode_efficiency))
    active, peak = lay.shard.active, device.bf16_flops  # an MoE token goes through its top-k experts alone
    generation = gm.GenerationTime(
        gm.flops_seconds(2 * active * prompts * r.n * mean_response, engine_ranks, peak, mfu), decode)
    update = 8 if cfg.model.recompute == "full" else 6
    train_s = gm.flops_seconds(active * (2 + update) * trained * t.ppo_epochs, world_size, peak, mfu)
    notes = [f"  assumptions: responses average {mean_response_fraction:.0%} of rollout.max_response_length "
             f"and prompts half of data.max_prompt_length; MFU {mfu:.0%} of {peak / 1e12:.0f} TFLOP/s; "
             f"decode at {decode_efficiency:.0%} of {device.hbm_bytes_per_s / 1e12:.2f} TB/s; one generation "
             f"batch of {prompts} prompts per step (dynamic sampling may draw more)"]
    if r.placement == "separate":
        notes.append(f"  rollout.placement=separate: this plan is the {world_size} training GPUs'; the {engine_ranks} "
                     f"engine GPUs hold the {r.engine} engine alone (not planned), and the step estimate adds "
                     "generation and training as if they took turns (rollout.max_staleness overlaps them: "
                     "docs/async_rollouts.md)")
        bucket = (r.weight_sync_bucket_mb << 20) / GB
        notes.append(f"  engine ranks: a weight version streams in one bucket at a time, between generation batches: "
                     f"{bucket:.2f} GB of device memory besides vLLM's share (rollout.weight_sync_bucket_mb="
                     f"{r.weight_sync_bucket_mb}), no copy in host memory")
    if moe:
        notes.append(moe_plan.note(moe, lay.shard, ep=ep, edp=lay.edp if p.use_distributed_optimizer else None,
                                   dispatcher=dispatcher, rollout_tp=rollout.tensor_parallel if rollout else None))
    sleep_host = rollout.weights if rollout is not None and r.sleep_level == 1 else 0.0
    # mcore/offload.py copies the optimizer state (and the weights) into pinned host memory but
    # releases the gradients without a copy (every update zeroes them first): no host memory for them
    parts = {i.key: i.bytes for i in items}
    copied = parts.get("master", 0.0) + parts["adam"]
    if cfg.actor.offload_weights:
        copied += parts["weights"]
    offload = cfg.actor.offload_during_rollout
    node = gpus_per_node or device.gpus_per_node
    save = (moe_plan.save(lay.shard, tp=tp, dp=lay.state_dp, ep=ep, edp=lay.edp, gpus_per_node=node,
                          memory_efficient=cfg.checkpoint.memory_efficient_save,
                          background=cfg.checkpoint.async_save, weight_bytes=lay.weight_bytes)
            if p.use_distributed_optimizer else None)
    return Plan(items, device, pp, rollout, generation, trained, generation.seconds + train_s, sleep_host,
                copied if offload else 0.0, copied, node, offload, save, notes, lay.shard, world_size)
