"""Real Qwen2.5, Qwen3 dense and Qwen3-MoE shapes with random weights: for benchmarks, dry runs and tests
(nothing downloaded).

The shape fields below are those of the public base-model ``config.json`` files: Qwen2.5
(Qwen/Qwen2.5-{0.5B,1.5B,7B,32B}; the 32B values as in docs/reference/nvidia_stack.md 4.2), Qwen3
(Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}: every size has 8 KV heads of 128, whatever its width; up to 4B
the embeddings are tied) and Qwen3-MoE (Qwen/Qwen3-30B-A3B: 4 KV heads, 128 experts of width 768,
top-8; 30.5B parameters, 3.3B of them active per token). ``SHAPES`` names them all: the Qwen2.5 sizes
bare ("7B", the recipes' SHAPE), the Qwen3 ones with their family ("Qwen3-8B", "Qwen3-30B-A3B").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.convert.safetensors_io import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter
from megatron_dapo.convert.table import conversion_table

_QWEN2_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                 "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "use_sliding_window": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                 "eos_token_id": 151643}


def _qwen25(hidden, ffn, layers, heads, kv_heads, vocab, tied, **extra) -> dict[str, Any]:
    return {**_QWEN2_COMMON, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tied, **extra}


QWEN25_CONFIGS: dict[str, dict[str, Any]] = {
    "0.5B": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False, max_position_embeddings=131072),
    "32B": _qwen25(5120, 27648, 64, 40, 8, 152064, False, max_position_embeddings=131072, rms_norm_eps=1e-5),
}

_QWEN3_COMMON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "use_sliding_window": False, "attention_bias": False, "attention_dropout": 0.0,
                 "head_dim": 128, "num_key_value_heads": 8, "vocab_size": 151936, "bos_token_id": 151643,
                 "eos_token_id": 151645}


def _qwen3(hidden, ffn, layers, heads, tied) -> dict[str, Any]:
    return {**_QWEN3_COMMON, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "tie_word_embeddings": tied}


QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, True),
    "Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, True),
    "Qwen3-4B": _qwen3(2560, 9728, 36, 32, True),
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, False),
    "Qwen3-14B": _qwen3(5120, 17408, 40, 40, False),
    "Qwen3-32B": _qwen3(5120, 25600, 64, 64, False),
}
# Every layer sparse (decoder_sparse_step 1, no mlp_only_layers), no shared expert; intermediate_size is
# in the file but unused by such a model.
QWEN3_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {**_qwen3(2048, 6144, 48, 32, False), "architectures": ["Qwen3MoeForCausalLM"],
                      "model_type": "qwen3_moe", "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "output_router_logits": False},
}
SHAPES: dict[str, dict[str, Any]] = {**QWEN25_CONFIGS, **QWEN3_CONFIGS, **QWEN3_MOE_CONFIGS}


def shape_label(shape: str) -> str:
    """A ``SHAPES`` key as people say it: "Qwen2.5-7B", "Qwen3-8B"."""
    return f"Qwen2.5-{shape}" if shape in QWEN25_CONFIGS else shape


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_random_hf_checkpoint(config: dict[str, Any], out_dir: str | Path, *,
                               dtype: torch.dtype = torch.bfloat16,
                               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, seed: int = 0) -> int:
    """Write an HF checkpoint of ``config`` with random weights, one tensor at a time (memory: one
    shard). Norm weights are near 1, the rest N(0, 0.02), so a forward pass stays finite.
    Returns the bytes of weights written."""
    out_dir = Path(out_dir)
    table = conversion_table(config)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes)
    for task in table.tasks:
        for name, shape in zip(task.hf_names, task.mapping.hf_shapes(table.dims)):
            t = torch.randn(shape, generator=gen) * 0.02
            if name.endswith("norm.weight"):
                t += 1.0
            writer.add(name, t.to(dtype))
    writer.close()
    config = {**config, "dtype": _DTYPE_NAMES[dtype]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return writer.total_bytes
