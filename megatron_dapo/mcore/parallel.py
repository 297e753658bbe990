"""torch.distributed and Megatron's parallel state, checked against the model before anything is built.

``validate_parallel`` names every inconsistency (world size, heads, KV groups, layers per stage,
experts over the expert-parallel ranks) with the values and the fix; ``initialize_parallel`` runs it,
then starts the process group (gloo on CPU, NCCL on GPU) and ``initialize_model_parallel``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.gpu_binding import bind_gpu, check_bindings
from megatron_dapo import ranks
from megatron_dapo.config import ModelConfig, ParallelConfig, expert_pool
from megatron_dapo.config_moe import MoEConfig
from megatron_dapo.mcore.cpu_compat import require_cpu_compat
from megatron_dapo.mcore.model import hf_arch, padded_vocab_size, resolve_runtime


def validate_parallel(hf_config, *, parallel: ParallelConfig, model: ModelConfig, world_size: int,
                      on_gpu: bool | None = None, check_installed: bool = True,
                      responses_per_update: int | None = None) -> dict[str, int]:
    """Raise ValueError on the first inconsistency; return the derived sizes
    (data_parallel_size, padded_vocab_size, layers_per_chunk). ``check_installed=False``: for a
    layout that will run elsewhere (resolve_runtime). ``responses_per_update``: when the caller
    checks that DP splits them (layout.describe_layout), the TP sizes a refusal suggests do too."""
    arch = hf_arch(hf_config)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    dp = parallel.data_parallel_size(world_size)  # raises with the numbers when TP x PP x CP does not divide
    if (fault := _tp_fault(arch, tp)) is not None:
        raise ConfigError(f"{fault}; {_tp_advice(hf_config, parallel, world_size, responses_per_update)}")
    if arch.num_layers % (pp * vpp):
        raise ConfigError(f"num_hidden_layers={arch.num_layers} is not divisible by pipeline_model_parallel"
                         f"_size x virtual_pipeline_model_parallel_size = {pp} x {vpp}; pick sizes whose "
                         f"product divides {arch.num_layers} ({_divisors(arch.num_layers)})")
    if (fault := _ep_fault(arch, parallel, world_size)) is not None:
        raise ConfigError(fault)
    resolve_runtime(model, on_gpu, check_installed=check_installed)  # refuses a spec that is not installed
    return dict(data_parallel_size=dp,
                padded_vocab_size=padded_vocab_size(arch.vocab_size, model.make_vocab_size_divisible_by, tp),
                layers_per_chunk=arch.num_layers // (pp * vpp))


def check_training_layout(hf_config, parallel: ParallelConfig) -> None:
    """ValueError for layouts that build and train but cannot be checkpointed and resumed
    correctly (training only: conversion and export keep no optimizer state)."""
    if _tied_state_shift(hf_config, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                         parallel.use_distributed_optimizer):
        raise ConfigError("tie_word_embeddings with tensor_model_parallel_size > 1 and pipeline_model_parallel_size > "
                         "1 and the distributed optimizer: megatron-core 0.19.2 checkpoints the tied embedding's "
                         "optimizer state shifted by a row, and a resumed run trains a corrupted embedding; set "
                         "parallel.use_distributed_optimizer=false, or TP=1, or PP=1")


def _tied_state_shift(hf_config, tp: int, pp: int, distributed_optimizer: bool) -> bool:
    """Whether megatron-core 0.19.2 saves this layout's optimizer state of the tied embedding one row
    off (zeros at the end of each TP shard; its own "param range exceeds unpadded buffer" warning),
    which a resume copies into the weights: docs/DESIGN.md "Known upstream bugs"."""
    return bool(hf_config.get("tie_word_embeddings", False)) and tp > 1 and pp > 1 and distributed_optimizer


def _ep_fault(arch, parallel: ParallelConfig, world_size: int) -> str | None:
    """What ``parallel``'s expert-parallel size cannot do for this model at ``world_size``: EP must divide the
    experts and the ranks megatron-core draws it from, DP x CP (config.expert_pool)."""
    ep, cp = parallel.expert_model_parallel_size, parallel.context_parallel_size
    dp, pool = parallel.data_parallel_size(world_size), parallel.expert_pool(world_size)
    experts = arch.num_moe_experts
    if ep == 1:
        return None
    if not experts:
        return (f"parallel.expert_model_parallel_size={ep} for a dense model (no experts to split); "
                "set it to 1")
    if experts % ep:
        return (f"parallel.expert_model_parallel_size={ep} does not divide the model's num_experts={experts}; "
                f"pick one of {[d for d in _divisors(experts) if pool % d == 0]}")
    if pool % ep:
        what = f"the data-parallel size {dp}" if cp == 1 else f"DP x CP = {dp} x {cp}"
        return (f"parallel.expert_model_parallel_size={ep} does not divide {what} (world / (TP x PP)): megatron "
                "takes the expert-parallel ranks from the data- and context-parallel ones; "
                f"pick one of {[d for d in _divisors(pool) if experts % d == 0]} or change the number of processes")
    return None


def check_packing(*, transformer_impl: str) -> None:
    """train.pack_sequences where it has been verified: the local spec's attention (sdpa_attention.py),
    dense or MoE, at TP, PP, CP, DP, EP and their products; a ConfigError on the Transformer Engine
    spec (docs/packing.md)."""
    if transformer_impl == "transformer_engine":
        raise ConfigError("train.pack_sequences=true is not supported with the Transformer Engine spec (its THD "
                          "attention has not run on a GPU here); set train.pack_sequences=false")


def check_moe_layout(hf_config, *, moe: MoEConfig, parallel: ParallelConfig) -> None:
    """The mixture-of-experts settings this model or layout cannot run; a ConfigError (the machine's:
    launch_checks.check_model)."""
    arch = hf_arch(hf_config)
    if not arch.num_moe_experts:
        if moe.router_replay == "R3":
            raise ConfigError("moe.router_replay=R3 for a dense model (model.hf_path's config has no experts); set "
                              "moe.router_replay=disabled")
        return
    tp = parallel.tensor_model_parallel_size
    if tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(f"an MoE model at TP {tp} needs parallel.sequence_parallel=true (megatron-core's MoE "
                          "layer routes each TP rank's share of the tokens)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_fault(arch, tp: int) -> str | None:
    """What of the model a tensor-parallel size of ``tp`` cannot split, or None when it splits it all."""
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    if heads % tp:
        return f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}"
    # megatron-core 0.19.2 shards KV groups when TP divides them and replicates them when they
    # divide TP (attention.py: num_query_groups < world_size gathers the QKV output).
    if groups % tp and tp % groups:
        return (f"num_key_value_heads={groups} and tensor_model_parallel_size={tp}: neither divides the other "
                "(megatron shards KV heads over TP, or replicates them when TP is a multiple of them)")
    if arch.hidden_size % tp or arch.ffn_hidden_size % tp:
        return (f"hidden_size={arch.hidden_size} and intermediate_size={arch.ffn_hidden_size} must be divisible "
                f"by tensor_model_parallel_size={tp}")
    if arch.moe_ffn_hidden_size % tp:  # megatron's expert TP is TP: each expert's MLP is split as the dense one
        return (f"moe_intermediate_size={arch.moe_ffn_hidden_size} must be divisible by "
                f"tensor_model_parallel_size={tp}")
    return None


def _fitting_tps(hf_config, parallel: ParallelConfig, world_size: int) -> list[int]:
    """The tensor-parallel sizes the layout checks accept for this model at ``world_size``, the other
    sizes of ``parallel`` kept: every TP check of validate_parallel, a world that TP x PP x CP
    divides, and check_training_layout's (a suggestion must work for training too)."""
    arch = hf_arch(hf_config)
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    rest = pp * parallel.context_parallel_size
    return [tp for tp in _divisors(arch.num_attention_heads)
            if _tp_fault(arch, tp) is None and world_size % (tp * rest) == 0
            and expert_pool(world_size, tp, pp) % ep == 0
            and not (tp == 1 and parallel.sequence_parallel)  # the config refuses sequence parallelism at TP 1
            and not (arch.num_moe_experts and tp > 1 and not parallel.sequence_parallel)  # check_moe_layout's rule
            and not _tied_state_shift(hf_config, tp, parallel.pipeline_model_parallel_size,
                                      parallel.use_distributed_optimizer)]


def _tp_advice(hf_config, parallel: ParallelConfig, world_size: int, responses_per_update: int | None) -> str:
    """The fix of a TP the model cannot take: the sizes it takes (TP 1 always does, in a world that PP x
    CP divides: data_parallel_size refuses the others first), less those whose DP would not split an
    update's ``responses_per_update`` when given."""
    fits = _fitting_tps(hf_config, parallel, world_size)
    pp, cp = parallel.pipeline_model_parallel_size, parallel.context_parallel_size
    where = f"at world size {world_size} with PP {pp} x CP {cp}"
    if responses_per_update is not None:
        dps = [world_size // (tp * pp * cp) for tp in fits]
        split = [tp for tp, dp in zip(fits, dps) if responses_per_update % dp == 0]
        if not split:
            return (f"the sizes this model takes {where}, {fits}, give DP {dps}, none of which splits the "
                    f"{responses_per_update} responses of an update "
                    "(train.mini_batch_prompts x rollout.n): change train.mini_batch_prompts or the number of "
                    "processes too")
        fits = split
    return f"set parallel.tensor_model_parallel_size to one that fits this model {where}: {fits}"


def initialize_parallel(hf_config, *, parallel: ParallelConfig, model: ModelConfig, seed: int) -> dict[str, int]:
    """Validate, then start torch.distributed (env:// as torchrun sets it; a one-process world
    when started without a launcher) and megatron's model-parallel groups and RNG tracker.
    Returns ``validate_parallel``'s sizes.

    Every group's collectives wait at most ``parallel.timeout_minutes``.
    ``seed`` seeds megatron's RNG tracker (model_parallel_cuda_manual_seed), which attention
    dropout and recompute fork even when dropout is 0.
    """
    require_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    on_gpu = torch.cuda.is_available()
    world_size = ranks.world_size()
    sizes = validate_parallel(hf_config, parallel=parallel, model=model, world_size=world_size, on_gpu=on_gpu)
    timeout_minutes = parallel.timeout_minutes
    if not dist.is_initialized():
        binding = bind_gpu() if on_gpu else None
        backend, timeout = "nccl" if on_gpu else "gloo", datetime.timedelta(minutes=timeout_minutes)
        if ranks.launched():
            dist.init_process_group(backend, timeout=timeout)
        else:  # plain `python ...`: no launcher, no rendezvous address needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        if binding is not None:  # NCCL has built no communicator yet: it would refuse two ranks on one GPU late
            check_bindings(_every_rank(binding))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return sizes


def _every_rank(obj) -> list:
    """Every rank's ``obj`` of the default world, in rank order, over a gloo group of its own."""
    group = dist.new_group(backend="gloo")
    try:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    finally:
        dist.destroy_process_group(group)


def all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """[n] on every rank of ``group`` (same n and dtype everywhere) -> [group size, n], in rank
    order: the one DP gather of the package (batch counts, metrics, inference log-probs). A group
    of one gathers nothing (two such gathers per update were a visible cost on the CPU demo)."""
    size = dist.get_world_size(group)
    if size == 1:
        return local[None].clone()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered)


def shutdown_distributed() -> None:
    """The end of a process that ran megatron (train, eval, the conversion CLIs): tear its groups
    down. Left alive, gloo can abort the interpreter at exit ("terminate called without an active
    exception", exit -6), after all the work succeeded."""
    if dist.is_initialized():
        destroy_parallel()


def destroy_parallel(process_group: bool = True) -> None:
    """Tear down megatron's groups and, unless told not to, the process group (gloo can abort at
    interpreter exit when it is left alive)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
