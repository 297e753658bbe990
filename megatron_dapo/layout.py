"""The resolved layout of a run at a world size, checked before anything launches.

``megatron-dapo config --config F --world-size N [--shape 32B]`` prints it, and every launcher's dry
run (recipes/) calls it: Megatron's TP x PP x CP x DP with the layers per stage and the vocabulary
padding, the rollout replicas, and the batch arithmetic of one step. The model's shape comes from
``model.hf_path``'s config.json when it is on this host, else, on a machine without the weights (a
login node, CI), from the Qwen2.5 or Qwen3 (dense or MoE) shape named by ``shape`` (convert/synthetic.py),
said as nominal.
Every inconsistency is an InputError naming the values and the fix, as at the start of a real run.
Memory is not planned here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_dapo.config import DAPOConfig, ModelConfig, MoEConfig, ParallelConfig
from megatron_dapo.errors import InputError
from megatron_dapo.gpu_models import nccl_comm_bytes
from megatron_dapo.moe_plan import expert_data_parallel
from megatron_dapo.plan_params import experts


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "tie_word_embeddings", "head_dim", "model_type", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size")  # what the layout and the plan read


def model_shape(model: ModelConfig, shape: str | None = None) -> tuple[dict, str]:
    """(HF config dict, where it came from): model.hf_path's config.json whenever it is on this host
    (what will run, even under a recipe that names another ``shape``), else the nominal ``shape``
    (a Qwen2.5, Qwen3 or Qwen3-MoE size: convert/synthetic.SHAPES), said as such."""
    from megatron_dapo.convert.synthetic import SHAPES, shape_label

    if shape is not None and shape not in SHAPES:
        raise InputError(f"--shape {shape!r} is not one of {list(SHAPES)} (Qwen2.5, Qwen3 and Qwen3-MoE sizes)")
    path = Path(model.hf_path) / "config.json" if model.hf_path else None
    if path is not None and path.is_file():
        hf = json.loads(path.read_text())
        if shape is not None and any(hf.get(k) != SHAPES[shape].get(k) for k in SHAPE_KEYS):
            return hf, f"{path} (not the {shape_label(shape)} shape the launch names: planned as found)"
        return hf, str(path)
    if shape is not None:
        where = f"model.hf_path={model.hf_path} is not on this host" if model.hf_path else "no model.hf_path"
        return SHAPES[shape], f"the nominal {shape_label(shape)} shape ({where})"
    raise InputError(f"{path or 'model.hf_path'} not found: point model.hf_path at the HF model, or name its shape "
                     f"with --shape ({', '.join(SHAPES)})")


def describe_layout(cfg: DAPOConfig, world_size: int, hf_config: dict, source: str, *, on_gpu: bool = True) -> str:
    """The layout's lines (see module docstring) for the model ``model_shape`` returned
    (``hf_config`` from ``source``); InputError when it cannot run at ``world_size``."""
    from megatron_dapo.errors import ConfigError
    from megatron_dapo.mcore.parallel import check_moe_layout, check_training_layout, validate_parallel
    from megatron_dapo.rollout.placement import replica_layout
    from megatron_dapo.rollout.worlds import rank_counts

    p, d, t = cfg.parallel, cfg.data, cfg.train
    where = f"at world size {world_size}"
    try:
        trainers, engines = rank_counts(cfg.rollout, world_size)
        if trainers != world_size:  # the checks below see the trainers' world alone
            where += f" (its first {trainers} ranks training; rollout.num_ranks={engines} hold the engines)"
        sizes = validate_parallel(hf_config, parallel=p, model=cfg.model, world_size=trainers, on_gpu=on_gpu,
                                  check_installed=False, responses_per_update=t.mini_batch_prompts * cfg.rollout.n)
        check_training_layout(hf_config, p)
        check_moe_layout(hf_config, moe=cfg.moe, parallel=p)
        _, replicas, _ = replica_layout(0, engines, cfg.rollout.tensor_parallel_size)
    except ConfigError as e:  # the checks' own errors; anything else is a bug and keeps its traceback
        raise ConfigError(f"{where}: {e}") from e
    dp = sizes["data_parallel_size"]
    if (t.mini_batch_prompts * cfg.rollout.n) % dp:
        raise ConfigError(f"train.mini_batch_prompts x rollout.n = {t.mini_batch_prompts} x {cfg.rollout.n} responses "
                          f"per update do not split over DP={dp}; pick a mini-batch divisible by {dp}")
    layers = hf_config["num_hidden_layers"]
    gen = d.gen_prompts_per_batch if cfg.algorithm.filter_groups.enable else d.prompts_per_step
    ep, moe = p.expert_model_parallel_size, experts(hf_config)
    edp = expert_data_parallel(trainers, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, ep)
    return "\n".join([
        f"model: {source}: {layers} layers, hidden {hf_config['hidden_size']}, {hf_config['num_attention_heads']} "
        f"heads / {hf_config['num_key_value_heads']} KV groups, "
        + (f"{moe.count} experts (top-{moe.topk}), " if moe else "")
        + f"vocabulary {hf_config['vocab_size']} (padded to {sizes['padded_vocab_size']})",
        f"layout at world size {world_size}"
        + (f" ({trainers} training, the last {engines} holding only engines)" if trainers != world_size else "")
        + f": TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size}"
        f" x CP {p.context_parallel_size} x DP {dp}"
        + (f" (EP {ep} of it: expert DP {edp})" if moe else "")
        + f"; {sizes['layers_per_chunk']} layers per pipeline chunk; "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}; distributed optimizer "
        f"{'on' if p.use_distributed_optimizer else 'off'}",
        f"rollout: {replicas} engine replica(s) of rollout TP {cfg.rollout.tensor_parallel_size} "
        f"({cfg.rollout.engine}), {cfg.rollout.n} responses per prompt, up to {cfg.rollout.max_response_length} tokens",
        f"step: {d.prompts_per_step} prompts x {cfg.rollout.n} responses, {cfg.updates_per_step} update(s) of "
        f"{t.mini_batch_prompts} prompts ({t.mini_batch_prompts * cfg.rollout.n // dp} responses per DP rank); "
        f"generation batches of {gen} prompts",
    ])


@dataclass(frozen=True)
class Communicator:
    """A process group whose NCCL communicator holds device buffers on every member rank."""

    owner: Literal["trainer", "vLLM"]
    name: str
    ranks: int

    @property
    def bytes(self) -> float:
        return nccl_comm_bytes(self.ranks)


def communicators(cfg: DAPOConfig, world_size: int, *, dispatcher: str | None = None) -> list[Communicator]:
    """The groups a rank runs collectives on at this layout (PyTorch creates a communicator at a
    group's first collective): the default group (preemption.py's stop agreement), megatron's
    gradient-norm group (the whole distributed-optimizer instance, else TP x PP), TP, PP, CP, DP
    (the package's gathers) and DP x CP (DDP and the distributed optimizer: its own communicator
    even when CP is 1); vLLM's TP and DP groups (PyNccl, built with the engine). ``world_size``: the
    trainers' ranks; with separate placement trainer rank 0 also holds the transfer group (it and
    every engine rank: rollout/worlds.py). ``dispatcher``: an MoE model's token dispatcher, whose
    groups are ``expert_communicators``' (None: a dense model)."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = p.data_parallel_size(world_size)
    groups = [("trainer", "world", world_size),
              ("trainer", "grad norm", world_size if p.use_distributed_optimizer else tp * pp),
              ("trainer", "TP", tp), ("trainer", "PP", pp), ("trainer", "CP", cp), ("trainer", "DP", dp),
              ("trainer", "DP x CP", dp * cp)]
    if dispatcher is not None:
        groups += expert_communicators(cfg.moe, cfg.parallel, world_size, dispatcher)
    if cfg.rollout.placement == "separate":
        groups.append(("trainer", "transfer", 1 + cfg.rollout.num_ranks))
    if cfg.rollout.engine == "vllm" and cfg.rollout.placement == "colocated":
        rtp = cfg.rollout.tensor_parallel_size
        groups += [("vLLM", "TP", rtp), ("vLLM", "DP", world_size // rtp)]
    return [Communicator(o, n, r) for o, n, r in groups if r > 1]


def expert_communicators(moe: MoEConfig, parallel: ParallelConfig, world_size: int,
                          dispatcher: str) -> list[tuple[str, str, int]]:
    """An MoE model's groups besides the dense ones, each a group object of its own in megatron's
    parallel_state, so a communicator of its own even over the same ranks as another (megatron-core
    0.19.2): the dispatcher's, the expert-data-parallel group (the expert gradients' reduce-scatter and
    their optimizer), the router's load-balancing reduction, and without the distributed optimizer the
    expert optimizer's gradient-norm group (optimizer/__init__.py:882, TP x EP x PP)."""
    p, lb = parallel, moe.load_balancing if moe.aux_loss_coeff != 0 else "none"
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, dp = p.expert_model_parallel_size, p.data_parallel_size(world_size)
    if dispatcher == "alltoall":  # token counts over TP x EP (:565), tokens over EP (:698), over expert TP (:739)
        groups = [("TP x EP", tp * ep), ("EP", ep), ("expert TP", tp)]
    else:  # tokens, routing map and probabilities gathered over TP x EP (token_dispatcher.py:287-296)
        groups = [("TP x EP", tp * ep)]
    groups.append(("expert DP", expert_data_parallel(world_size, tp, pp, ep)))
    if lb in ("aux_loss", "seq_aux_loss"):  # tokens per expert summed over TP x CP (transformer/moe/router.py:422)
        groups.append(("router TP x CP", tp * cp))
    elif lb == "global_aux_loss":  # and over TP x DP x CP (router.py:520)
        groups.append(("router TP x DP x CP", tp * dp * cp))
    if not p.use_distributed_optimizer:
        groups.append(("expert grad norm", tp * ep * pp))
    return [("trainer", name, ranks) for name, ranks in groups]
