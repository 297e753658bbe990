"""Qwen3 dense (``Qwen3ForCausalLM``): no q/k/v biases, an RMSNorm over each head's query and key
before RoPE (``q_norm`` / ``k_norm``, ``head_dim`` wide), and a ``head_dim`` of its own (Qwen3-0.6B:
16 heads x 128 over a hidden size of 1024); the table is decoder.py's."""

from __future__ import annotations

import functools
from typing import Any

from megatron_dapo.convert.decoder import check_dense_config, dense_decoder_table
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.table import register_architecture


def check_qwen3_config(config: dict[str, Any]) -> None:
    check_dense_config("Qwen3", config)
    if not config.get("head_dim"):  # transformers would take 128; hidden_size / heads is what we would read
        raise ConversionError("Qwen3 config.json without head_dim: its size is not hidden_size / num_attention_heads "
                              "(the released ones say 128); add it to config.json")
    if config.get("attention_bias"):  # transformers' Qwen3Attention then puts biases on q/k/v and o
        raise ConversionError("Qwen3 with attention_bias=true is unsupported (the released checkpoints have none)")


ATTENTION = dict(qkv_bias=False, qk_layernorm=True)  # what the Megatron model is built with (mcore/model.py)
register_architecture("Qwen3ForCausalLM", model_type="qwen3", check_config=check_qwen3_config, **ATTENTION)(
    functools.partial(dense_decoder_table, **ATTENTION))
