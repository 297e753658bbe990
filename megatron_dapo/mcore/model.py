"""A megatron-core ``GPTModel`` for a Qwen2 / Qwen2.5, Qwen3 dense or Qwen3-MoE architecture, built from its
HF config.json.

In Megatron terms: grouped-query attention (num_query_groups = num_key_value_heads), RMSNorm,
SwiGLU (gated linear unit + SiLU), RoPE with base ``rope_theta`` over the whole head, tied or untied
embeddings, no linear biases but Qwen2's on the QKV projection (add_qkv_bias); Qwen3 has no biases,
RMSNorm over each head's query and key (qk_layernorm) and a head size of its own (kv_channels =
head_dim). Which architecture has which: convert/qwen2.py, convert/qwen3.py.
References: docs/reference/nvidia_stack.md 4.2 (Qwen2.5-32B flags) and megatron-core 0.19.2
``TransformerConfig`` / ``GPTModel``.

Two layer specs: Transformer Engine (``get_gpt_layer_with_transformer_engine_spec``; GPU, bf16,
optional FP8) and megatron's local spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``;
CPU, fp32). Parameter names are Megatron's own and differ between the two (the TE spec fuses the
input norm into ``linear_qkv.layer_norm_weight``); the conversion code maps both.

Fused kernels (RoPE, bias-activation, masked softmax) stay off: NeMo-RL #1801 traced most
trainer/vLLM log-prob spikes to them, and the log-probs here must match the rollout engine's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from megatron_dapo.errors import ConfigError
from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.config_moe import MoEConfig
from megatron_dapo.convert.table import architecture, model_sizes
from megatron_dapo.mcore.cpu_compat import require_cpu_compat
from megatron_dapo.micro_batch_shapes import exchanges_shapes
from megatron_dapo.precision import resolve_dtype, resolve_token_dispatcher, resolve_transformer_impl


@dataclass(frozen=True)
class HFArch:
    """The architecture fields of a Qwen2 / Qwen3 config.json, named as Megatron names them."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    init_std: float
    attention_dropout: float
    add_qkv_bias: bool
    qk_layernorm: bool
    num_moe_experts: int  # 0: a dense model
    moe_ffn_hidden_size: int
    moe_router_topk: int
    moe_norm_topk_prob: bool  # top-k weights renormalised to sum to 1 (Qwen3-30B-A3B: true)
    moe_aux_loss_coeff: float  # the checkpoint's router_aux_loss_coef


def hf_arch(hf_config: Mapping[str, Any] | Any) -> HFArch:
    """Read a Qwen2 / Qwen3 config: a config.json dict, its path or directory, or a transformers config.

    Raises ValueError for an architecture or a feature this model does not implement (the
    architecture's own checks, convert/table.architecture: sliding window, an activation other than
    SiLU, ...; scaled RoPE here) rather than building a model that silently differs.
    """
    cfg = _as_dict(hf_config)
    found = architecture(cfg)  # a ConversionError (a ValueError) names what is not implemented
    # transformers >= 5 keeps RoPE settings in rope_parameters; config.json files written by 4.x
    # keep rope_theta (and an optional rope_scaling) at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    for rope_type in (rope.get("rope_type", "default"), scaling_type):
        if rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} (rope_scaling / rope_parameters) is not "
                             "supported; remove it from config.json for contexts within the trained length")
    return HFArch(
        **model_sizes(cfg),
        norm_eps=cfg["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg["max_position_embeddings"],
        init_std=cfg.get("initializer_range", 0.02),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        add_qkv_bias=found.qkv_bias,
        qk_layernorm=found.qk_layernorm,
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 0),
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0),
    )


def _as_dict(hf_config) -> dict:
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
        with open(path) as f:
            return json.load(f)
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return hf_config.to_dict()  # a transformers PretrainedConfig


def conversion_table_for(hf_config: Mapping[str, Any], *, model: ModelConfig, tp: int):
    """The HF <-> Megatron table (convert/) at the vocabulary padding this model has at TP=``tp``."""
    from megatron_dapo.convert import conversion_table

    vocab = padded_vocab_size(hf_arch(hf_config).vocab_size, model.make_vocab_size_divisible_by, tp)
    return conversion_table(hf_config, padded_vocab_size=vocab)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round up to a multiple of lcm(divisible_by, TP); unchanged when it divides.

    Deliberately not Megatron-LM's divisible_by x TP: with that rule the padded size depends on TP
    (Qwen2.5-0.5B's 151936 rows become 152064 at TP=2), so a checkpoint saved at one TP would not
    load at another. With divisible_by = 128 every power-of-two TP up to 128 gives the same size.
    The extra rows are never real tokens: log-probs mask them (see logprobs.py, valid_vocab_size)
    and conversion drops them on export.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Runtime:
    """What ModelConfig's "auto" values resolve to on this machine."""

    transformer_impl: str  # "local" | "transformer_engine"
    params_dtype: torch.dtype


def _require_te() -> None:
    """Transformer Engine as megatron sees it. megatron-core's TE extension imports names from
    ``transformer_engine.pytorch.fp8`` and, when one is missing, silently puts a MagicMock in TE's
    place (extensions/transformer_engine.py, ``HAVE_TE = False``): a find_spec check passes and the
    model is built of mocks. A TE without that module fails inside megatron's own imports
    (fp8_utils.py) with a bare ModuleNotFoundError. Both become this one line."""
    fix = "use the NGC container (container/Dockerfile) or set model.transformer_impl=local"
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("model.transformer_impl=transformer_engine (the GPU default) needs Transformer Engine: "
                          + fix)
    try:
        from megatron.core.extensions import transformer_engine as mcore_te
        usable, why = mcore_te.HAVE_TE, "its pytorch.fp8 lacks a name megatron-core imports"
    except ImportError as e:
        usable, why = False, str(e)
    if not usable:
        raise ConfigError(f"Transformer Engine is installed, but megatron-core cannot use it ({why}): a TE "
                          f"version megatron-core does not know; {fix}, or install the TE the container pins")


def resolve_runtime(model: ModelConfig, on_gpu: bool, *, check_installed: bool = True) -> Runtime:
    """``check_installed=False``: a layout check for another machine (a launcher's dry run on a login
    node) does not ask for Transformer Engine here."""
    impl = resolve_transformer_impl(model.transformer_impl, on_gpu)
    if impl == "transformer_engine" and not on_gpu:
        raise ConfigError("model.transformer_impl=transformer_engine needs CUDA; use local (or auto) on CPU")
    if check_installed and impl == "transformer_engine":
        _require_te()
    if model.fp8 is not None and impl != "transformer_engine":
        raise ConfigError(f"model.fp8={model.fp8!r} needs the Transformer Engine spec (a GPU); "
                         "set model.fp8=null")
    dtype = resolve_dtype(model.dtype, on_gpu)
    return Runtime(impl, torch.bfloat16 if dtype == "bf16" else torch.float32)


def transformer_config_from_hf(hf_config, *, model: ModelConfig, parallel: ParallelConfig,
                               on_gpu: bool | None = None, moe: MoEConfig | None = None, **overrides):
    """The megatron ``TransformerConfig`` for a Qwen2 / Qwen3 config under the given model / parallel settings.

    ``overrides`` are set on the TransformerConfig last (e.g. calculate_per_token_loss for the
    train step, hidden_dropout for a test). The architecture part alone is ``hf_arch``.
    """
    require_cpu_compat()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    arch = hf_arch(hf_config)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    rt = resolve_runtime(model, on_gpu)
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    te = rt.transformer_impl == "transformer_engine"
    fields: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_qkv_bias=arch.add_qkv_bias,
        add_bias_linear=False,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,  # Qwen has none, and RL log-probs must be deterministic
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.init_std,
        # With TE: megatron's fused SwiGLU and TE's fused rope (not on the CPU's local spec). Off: softmax
        # and bias-dropout fusion (flash attention has no separate softmax; there is no dropout),
        # and wgrad accumulation fusion, which writes into DDP's main_grad and so breaks every
        # model built without DDP (conversion, export, the GPU tests' bare models).
        bias_activation_fusion=te,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        transformer_impl=rt.transformer_impl,
        attention_backend=AttnBackend.auto if on_gpu else AttnBackend.local,
        params_dtype=rt.params_dtype,
        bf16=rt.params_dtype == torch.bfloat16,
        pipeline_dtype=rt.params_dtype,
        use_cpu_initialization=not on_gpu,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel_size,
        # RL micro-batches differ in length, so stages exchange shapes first. TransformerConfig
        # rejects that with its default MoE dispatcher even for a dense model; none runs here.
        # Not for interleaved PP=2: p2p_communication._communicate_shapes always batches its ops
        # and pairs them wrongly when prev == next; train_step then pads micro-batches to one shape.
        variable_seq_lengths=exchanges_shapes(pp, vpp),
        moe_token_dispatcher_type="alltoall",
        # With interleaving and PP=2, prev and next stage are the same rank and the batched p2p
        # op list pairs sends with the wrong receives: silently wrong results
        # (docs/reference/megatron_on_cpu.md 3b; megatron-training asserts this case away).
        batch_p2p_comm=not (vpp is not None and pp == 2),
    )
    if arch.num_moe_experts:
        fields.update(moe_fields(arch, moe or MoEConfig(), parallel, on_gpu))
    if model.recompute == "selective":
        fields.update(recompute_granularity="selective")  # megatron default module: core_attn
    elif model.recompute == "full":
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if rt.transformer_impl == "transformer_engine" and model.fp8 is not None:
        fields.update(fp8=model.fp8, fp8_recipe=model.fp8_recipe)
    fields.update(overrides)
    return TransformerConfig(**fields)


def moe_fields(arch: HFArch, moe: MoEConfig, parallel: ParallelConfig, on_gpu: bool) -> dict[str, Any]:
    """The TransformerConfig fields of a Qwen3-MoE layer.

    Routing as transformers' Qwen3MoeTopKRouter: a softmax over every expert's logit (fp32), the top k
    kept and, with norm_topk_prob, renormalised to sum to 1. Megatron's default (a softmax over the top
    k logits) is the renormalised form exactly; without norm_topk_prob the softmax comes first
    (moe_router_pre_softmax). SequentialMLP experts (no grouped GEMM): one module per expert under
    both layer specs, the names convert/decoder.moe_mlp maps; TE's grouped MLP needs TE >= 2.14.
    """
    dispatcher = resolve_token_dispatcher(moe.token_dispatcher, on_gpu)
    coeff = arch.moe_aux_loss_coeff if moe.aux_loss_coeff == "auto" else moe.aux_loss_coeff
    return dict(
        num_moe_experts=arch.num_moe_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=coeff if moe.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        moe_enable_routing_replay=moe.router_replay == "R3",
        # megatron's allgather dispatcher refuses variable shapes between pipeline stages: the
        # stages then exchange micro-batches padded to one shape (train_step, logprobs)
        **(dict(variable_seq_lengths=False) if dispatcher == "allgather" else {}),
    )


def layer_spec(config):
    """Megatron's TE spec or local spec (RMSNorm through torch), per config.transformer_impl; the
    local spec's core attention is torch's fused SDPA (sdpa_attention.py: megatron's unfused
    DotProductAttention keeps [b, heads, s, s] probabilities per layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_dapo.mcore.sdpa_attention import SDPAttention

    experts = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if config.transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **experts)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm, **experts)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(hf_config, *, model: ModelConfig, parallel: ParallelConfig,
                on_gpu: bool | None = None, moe: MoEConfig | None = None, **overrides) -> list:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (a list of one
    without VPP), with pre/post-process set from the pipeline position.

    Needs ``initialize_parallel`` (parallel.py) to have run with the same ``parallel`` settings.
    Weights are freshly initialised; the conversion code loads real ones. Output logits are
    vocab-parallel [b, s, padded_vocab / TP].
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    arch = hf_arch(hf_config)
    _check_parallel_state(parallel)
    config = transformer_config_from_hf(hf_config, model=model, parallel=parallel, on_gpu=on_gpu, moe=moe,
                                        **overrides)
    vocab = padded_vocab_size(arch.vocab_size, model.make_vocab_size_divisible_by,
                              parallel.tensor_model_parallel_size)
    spec = layer_spec(config)
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,  # keep logits vocab-parallel: logprobs.py never gathers them
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            vp_stage=stage,
        ))
        # GPTModel keeps only the padded size; checkpoints record the real one (checkpoint.model_shape)
        chunks[-1].hf_vocab_size = arch.vocab_size
    if not config.use_cpu_initialization:
        # megatron's parallel layers are born on the GPU, but not every module is (the local spec's
        # torch RMSNorm, rotary buffers): move the rest, as megatron-training's get_model does.
        # Found on the first GPU run (tools/gpu_smoke.sh): without it the norms stayed on the CPU.
        import torch

        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    return chunks


def _check_parallel_state(parallel: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call megatron_dapo.mcore.parallel.initialize_parallel(...) before build_model")
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())
    want = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size, parallel.context_parallel_size,
            parallel.expert_model_parallel_size)
    if have != want:
        raise ValueError(f"parallel state (TP, PP, VPP, CP, EP) = {have} but the ParallelConfig asks for "
                         f"{want}; initialise with the same ParallelConfig")
