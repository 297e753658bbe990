"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK layernorm, no biases, a head_dim of its
own) with every MLP a router over ``num_experts`` routed experts (no shared one), ``num_experts_per_tok``
of them per token (Qwen3-30B-A3B: 128 experts, top-8, moe_intermediate_size 768); the table is
decoder.py's with ``moe=True``. On disk each expert is a tensor of its own
(``model.layers.L.mlp.experts.E.gate_proj.weight``), as the released checkpoints store them."""

from __future__ import annotations

import functools
from typing import Any

from megatron_dapo.convert.decoder import dense_decoder_table
from megatron_dapo.convert.mapping import ConversionError, hf_sizes
from megatron_dapo.convert.qwen3 import ATTENTION, check_qwen3_config
from megatron_dapo.convert.table import register_architecture


def check_qwen3_moe_config(config: dict[str, Any]) -> None:
    check_qwen3_config(config)
    experts = hf_sizes(config)["num_moe_experts"]  # either spelling
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if not config.get(k)]
    if missing or not experts:
        raise ConversionError(f"Qwen3-MoE config.json lacks {missing + ([] if experts else ['num_experts'])}")
    if config["num_experts_per_tok"] > experts:
        raise ConversionError(f"num_experts_per_tok={config['num_experts_per_tok']} exceeds num_experts={experts}")
    if config["num_experts_per_tok"] == 1 and config.get("norm_topk_prob"):
        # the renormalised weight of one expert is a constant 1: the router would get no gradient
        raise ConversionError("num_experts_per_tok=1 with norm_topk_prob=true is unsupported: megatron-core refuses a "
                              "top-1 softmax after the top-k (its weight is 1, the router learns nothing); set "
                              "norm_topk_prob=false or route to 2 or more experts")
    # transformers makes a layer dense when it is in mlp_only_layers or (layer + 1) % decoder_sparse_step:
    # the released checkpoints have every layer sparse, and so does the Megatron model built here.
    dense, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    if dense or step != 1:
        raise ConversionError(f"Qwen3-MoE with dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}) is "
                              "unsupported: every layer is built with experts (the released checkpoints have "
                              "mlp_only_layers=[] and decoder_sparse_step=1)")


register_architecture("Qwen3MoeForCausalLM", model_type="qwen3_moe", check_config=check_qwen3_moe_config, moe=True,
                      **ATTENTION)(functools.partial(dense_decoder_table, moe=True, **ATTENTION))
