"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the HF <-> Megatron-Core mapping table.

Names follow megatron-core's GPTModel: the local layer spec (``get_gpt_layer_local_spec``) has
separate norm modules; the Transformer Engine spec fuses them into ``linear_qkv`` and
``linear_fc1`` as ``layer_norm_weight`` (the ``te=`` names). Layout as in Megatron-Bridge's
qwen2_bridge.py (docs/reference/nvidia_stack.md section 3.4). Qwen2 has q/k/v biases (hard-coded
``bias=True`` in transformers' Qwen2Attention) and no other linear biases.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.convert.mapping import (
    ConversionError, ModelDims, ParamMapping, fused_qkv, gated_mlp, replicated, row_parallel, vocab_parallel,
)
from megatron_dapo.convert.table import register_architecture

HF = "model.layers.*."
MC = "decoder.layers.*."


def check_qwen2_config(config: dict[str, Any]) -> None:
    """Settings the Megatron model does not reproduce: refuse them before converting anything."""
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"Qwen2 with hidden_act={config['hidden_act']!r} is unsupported "
                              "(SwiGLU needs silu)")
    if config.get("use_sliding_window"):
        raise ConversionError("Qwen2 with use_sliding_window=true is unsupported: the Megatron model "
                              "attends over the full causal context in every layer")


@register_architecture("Qwen2ForCausalLM", model_type="qwen2", check_config=check_qwen2_config)
def qwen2_table(dims: ModelDims) -> list[ParamMapping]:
    table = [
        # Embedding
        vocab_parallel("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        # Attention block: pre-norm, fused QKV (column parallel, with bias), output projection (row parallel)
        replicated(MC + "input_layernorm.weight", HF + "input_layernorm.weight",
                   te=MC + "self_attention.linear_qkv.layer_norm_weight"),
        fused_qkv(MC + "self_attention.linear_qkv.weight",
                  q=HF + "self_attn.q_proj.weight", k=HF + "self_attn.k_proj.weight",
                  v=HF + "self_attn.v_proj.weight"),
        fused_qkv(MC + "self_attention.linear_qkv.bias",
                  q=HF + "self_attn.q_proj.bias", k=HF + "self_attn.k_proj.bias",
                  v=HF + "self_attn.v_proj.bias"),
        row_parallel(MC + "self_attention.linear_proj.weight", HF + "self_attn.o_proj.weight",
                     shape=("hidden", "q")),
        # MLP block: pre-norm, fused gate/up (column parallel), down projection (row parallel)
        replicated(MC + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight",
                   te=MC + "mlp.linear_fc1.layer_norm_weight"),
        gated_mlp(MC + "mlp.linear_fc1.weight",
                  gate=HF + "mlp.gate_proj.weight", up=HF + "mlp.up_proj.weight"),
        row_parallel(MC + "mlp.linear_fc2.weight", HF + "mlp.down_proj.weight", shape=("hidden", "ffn")),
        # Final norm
        replicated("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    # Tied embeddings: HF stores no lm_head and Megatron has no output_layer (it reuses the embedding).
    if not dims.tie_word_embeddings:
        table.append(vocab_parallel("output_layer.weight", "lm_head.weight"))
    return table
