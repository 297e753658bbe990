"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): biases on the q/k/v projections (hard-coded ``bias=True``
in transformers' Qwen2Attention) and no other linear biases; the table is decoder.py's."""

from __future__ import annotations

import functools
from typing import Any

from megatron_dapo.convert.decoder import check_dense_config, dense_decoder_table
from megatron_dapo.convert.table import register_architecture


def check_qwen2_config(config: dict[str, Any]) -> None:
    check_dense_config("Qwen2", config)


ATTENTION = dict(qkv_bias=True, qk_layernorm=False)  # what the Megatron model is built with (mcore/model.py)
register_architecture("Qwen2ForCausalLM", model_type="qwen2", check_config=check_qwen2_config, **ATTENTION)(
    functools.partial(dense_decoder_table, **ATTENTION))
