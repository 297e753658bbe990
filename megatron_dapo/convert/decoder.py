"""The dense decoder shared by the Qwen2 and Qwen3 families: one HF <-> Megatron-Core table with the
attention features that set them apart.

Names follow megatron-core's GPTModel: the local layer spec (``get_gpt_layer_local_spec``) has
separate norm modules; the Transformer Engine spec fuses the pre-attention and pre-MLP norms into
``linear_qkv`` and ``linear_fc1`` as ``layer_norm_weight`` (the ``te=`` names). The per-head query and
key norms (``q_layernorm`` / ``k_layernorm``) are modules of their own under both specs. Layout as in
Megatron-Bridge's qwen2_bridge.py and qwen3_bridge.py (docs/reference/nvidia_stack.md section 3.4).
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.convert.mapping import (
    ConversionError, ModelDims, ParamMapping, fused_qkv, gated_mlp, replicated, row_parallel, vocab_parallel,
)

HF = "model.layers.*."
MC = "decoder.layers.*."


def check_dense_config(family: str, config: dict[str, Any]) -> None:
    """Settings the Megatron model does not reproduce: refuse them before converting anything."""
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{family} with hidden_act={config['hidden_act']!r} is unsupported "
                              "(SwiGLU needs silu)")
    sliding = [t for t in config.get("layer_types") or () if t != "full_attention"]
    if config.get("use_sliding_window") or sliding:
        raise ConversionError(f"{family} with use_sliding_window=true (or sliding layer_types) is unsupported: the "
                              "Megatron model attends over the full causal context in every layer")


def dense_decoder_table(dims: ModelDims, *, qkv_bias: bool, qk_layernorm: bool,
                        moe: bool = False) -> list[ParamMapping]:
    """Embedding, per layer a pre-norm attention block (fused QKV, column parallel; output projection,
    row parallel) and a pre-norm SwiGLU block, the final norm, and an output layer unless tied.
    ``moe``: the SwiGLU block is a router and ``dims.num_experts`` routed experts (moe_mlp)."""
    qkv = dict(q=HF + "self_attn.q_proj.", k=HF + "self_attn.k_proj.", v=HF + "self_attn.v_proj.")
    table = [
        vocab_parallel("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        replicated(MC + "input_layernorm.weight", HF + "input_layernorm.weight",
                   te=MC + "self_attention.linear_qkv.layer_norm_weight"),
        fused_qkv(MC + "self_attention.linear_qkv.weight", **{k: v + "weight" for k, v in qkv.items()}),
    ]
    if qkv_bias:
        table.append(fused_qkv(MC + "self_attention.linear_qkv.bias", **{k: v + "bias" for k, v in qkv.items()}))
    if qk_layernorm:
        table += [replicated(MC + "self_attention.q_layernorm.weight", HF + "self_attn.q_norm.weight",
                             shape=("head",)),
                  replicated(MC + "self_attention.k_layernorm.weight", HF + "self_attn.k_norm.weight",
                             shape=("head",))]
    table += [
        row_parallel(MC + "self_attention.linear_proj.weight", HF + "self_attn.o_proj.weight", shape=("hidden", "q")),
        *(moe_mlp() if moe else dense_mlp()),
        replicated("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    # Tied embeddings: HF stores no lm_head and Megatron has no output_layer (it reuses the embedding).
    if not dims.tie_word_embeddings:
        table.append(vocab_parallel("output_layer.weight", "lm_head.weight"))
    return table


def dense_mlp() -> list[ParamMapping]:
    """The pre-MLP norm and one SwiGLU MLP; the TE spec fuses the norm into linear_fc1."""
    return [replicated(MC + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight",
                       te=MC + "mlp.linear_fc1.layer_norm_weight"),
            gated_mlp(MC + "mlp.linear_fc1.weight", gate=HF + "mlp.gate_proj.weight", up=HF + "mlp.up_proj.weight"),
            row_parallel(MC + "mlp.linear_fc2.weight", HF + "mlp.down_proj.weight", shape=("hidden", "ffn"))]


def moe_mlp() -> list[ParamMapping]:
    """The pre-MLP norm, the router ([experts, hidden], the same on every rank) and per expert a SwiGLU
    MLP of ``moe_intermediate_size``, HF's ``mlp.experts.<e>`` -> megatron's SequentialMLP
    ``local_experts.<e>`` (global index here; export.local_parameters maps an EP rank's local index).
    The norm stays a module of its own under the TE spec: an MoE layer has no linear_fc1 to fuse it into."""
    experts_hf, experts_mc = HF + "mlp.experts.@.", MC + "mlp.experts.local_experts.@."
    return [replicated(MC + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight"),
            replicated(MC + "mlp.router.weight", HF + "mlp.gate.weight", shape=("experts", "hidden")),
            gated_mlp(experts_mc + "linear_fc1.weight", gate=experts_hf + "gate_proj.weight",
                      up=experts_hf + "up_proj.weight", ffn="moe_ffn"),
            row_parallel(experts_mc + "linear_fc2.weight", experts_hf + "down_proj.weight",
                         shape=("hidden", "moe_ffn"))]
