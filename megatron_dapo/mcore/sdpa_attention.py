"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local spec.

Megatron's local ``DotProductAttention`` (megatron-core 0.19.2) materialises the attention
scores and probabilities, [b, heads, s, s] each, repeats the KV heads to the query heads, and
saves the probabilities for backward: at 8 x 512 tokens and 8 heads that is 64 MB per tensor
per layer in fp32. torch's SDPA runs a fused (flash) kernel on CPU and GPU that keeps neither
and handles GQA itself (``enable_gqa``), so the local spec (the CPU path, and the GPU path
without Transformer Engine) trains faster and in less memory; benchmarks/train_step.py measures
it against HF transformers, whose Qwen2 uses the same kernel. The TE spec keeps TE's attention.

Covers what the local spec meets here: causal self-attention without dropout, bias or sliding
windows (anything else is refused at build time, naming the field), over padded rows or packed ones
(THD: megatron hands [t, heads, d] and the samples' boundaries in ``PackedSeqParams.cu_seqlens_q``):
each sample attends causally within itself, one kernel call per sample, so no token sees its
neighbour and nothing of size t x t is built. Under context parallelism each rank's queries attend
over the whole row's (or their segment's) keys and values, gathered over the CP group
(context_parallel.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_dapo.mcore.context_parallel import cp_attention, cp_packed_attention


class SDPAttention(torch.nn.Module):
    """A drop-in ``core_attention`` (megatron's CoreAttentionBuilder / CoreAttentionInterface).
    A plain module without parameters (nothing to checkpoint), so that importing it does not
    import megatron.core (the policy package's import has no side effects: cpu_compat.py)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__()
        self._causal = AttnMaskType.causal
        unsupported = {
            "attention_dropout": (config.attention_dropout if attention_dropout is None else attention_dropout) != 0,
            "window_size": config.window_size is not None,
            "softmax_type": config.softmax_type != "vanilla",
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
            "attn_mask_type": attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask),
        }
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ValueError(f"SDPAttention does not support {', '.join(bad)} (attention_dropout=0, "
                             f"no window, vanilla softmax, causal mask); "
                             f"use the Transformer Engine spec (model.transformer_impl) for these")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self._cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self._cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query: [sq, b, heads, d]; key, value: [sk, b, kv_heads, d]; attention_mask: None or
        megatron's bool mask (True = masked out), broadcastable to [b, heads, sq, sk]. Packed (THD):
        query [t, heads, d], key and value [t, kv_heads, d]. Returns [sq, b, heads * d] ([t, heads * d]
        packed)."""
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == self._causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        gqa = k.shape[1] != q.shape[1]
        if self._cp_group is not None:
            if not causal:
                raise ValueError("SDPAttention under context parallelism takes the causal mask only (no "
                                 "attention_mask)")
            out = cp_attention(q, k, v, scale=self.softmax_scale, group=self._cp_group, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, params):
        if params.qkv_format != "thd" or params.cu_seqlens_kv is not None and not torch.equal(
                params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError(f"SDPAttention packs self-attention in THD only (qkv_format={params.qkv_format!r}, "
                             "cu_seqlens_kv = cu_seqlens_q)")
        bounds = params.cu_seqlens_q.tolist()
        cp = 1 if self._cp_group is None else torch.distributed.get_world_size(self._cp_group)
        if bounds[0] != 0 or bounds[-1] != query.shape[0] * cp:
            raise ValueError(f"cu_seqlens_q must run from 0 to the {query.shape[0] * cp} packed tokens, got "
                             f"{bounds[0]} .. {bounds[-1]}")
        gqa = key.shape[1] != query.shape[1]
        if self._cp_group is not None:  # this rank's chunks of every segment (cu_seqlens are the whole row's)
            return cp_packed_attention(query, key, value, tuple(bounds), scale=self.softmax_scale,
                                       group=self._cp_group, enable_gqa=gqa)
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, n, d]
            piece = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            pieces.append(piece[0].transpose(0, 1).reshape(end - start, -1))
        return torch.cat(pieces)
