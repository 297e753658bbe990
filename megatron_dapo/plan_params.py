"""The parameter counts the memory plan rests on (memory_plan.py): the whole model's, the most loaded
rank's, the experts among them, and those one token goes through (the FLOPs model's).

Qwen2 (QKV biases), Qwen3 dense (per-head query/key norms; a head size of its own) and Qwen3-MoE, whose
every layer's MLP is a router [experts, hidden] and ``num_experts`` SwiGLU experts of
moe_intermediate_size (no shared expert; config.json's intermediate_size is then unused). megatron keeps
the router whole on every rank, splits the experts over EP and each expert's MLP over the expert TP,
which is TP here (mcore/model.moe_fields sets none of its own): a rank holds its stage's dense
parameters / TP and its experts / (TP x EP). A token goes through the attention, the router and its
top-k experts. Pure functions of the HF config dict: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Parameters of the whole model (``total``) and of the most loaded rank (``on_rank``)."""

    total: int
    on_rank: float
    experts_on_rank: float = 0.0  # of on_rank: expert weights (their optimizer state shards over expert DP)
    active: int = 0  # parameters one token goes through (the FLOPs model's); the total for a dense model


@dataclass(frozen=True)
class Experts:
    """An MoE layer's routed experts: how many, how many a token goes to, one expert's MLP width."""

    count: int
    topk: int
    ffn: int


def experts(hf: dict) -> Experts | None:
    """The routed experts of ``hf`` (None: a dense model, whatever a stray num_experts in it says)."""
    from megatron_dapo.convert.table import model_sizes

    sizes = model_sizes(hf)  # either spelling of the expert count; a dense architecture's is 0
    if not sizes["num_moe_experts"]:
        return None
    return Experts(sizes["num_moe_experts"], int(hf["num_experts_per_tok"]), sizes["moe_ffn_hidden_size"])


def active_ffn(hf: dict) -> int:
    """The MLP width one token goes through: intermediate_size, or top-k x moe_intermediate_size."""
    moe = experts(hf)
    return moe.topk * moe.ffn if moe else hf["intermediate_size"]


def count_parameters(hf: dict, *, tp: int, pp: int, padded_vocab: int, ep: int = 1) -> Shard:
    """Parameter counts of ``hf`` for the whole model and the most loaded rank at TP x PP (x EP)."""
    from megatron_dapo.convert.mapping import hf_sizes
    from megatron_dapo.convert.table import architecture

    sizes, found, moe = hf_sizes(hf), architecture(hf), experts(hf)
    h, layers, head_dim = sizes["hidden_size"], sizes["num_layers"], sizes["kv_channels"]
    q, kv = sizes["num_attention_heads"] * head_dim, sizes["num_query_groups"] * head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if found.qkv_bias else 0)  # q and o, k and v, their biases
    norms = 2 * h + (2 * head_dim if found.qk_layernorm else 0)  # replicated over TP
    if moe:  # gate, up, down per expert; the router replicated like the norms
        mlp, replicated = 0, norms + moe.count * h
        routed, active_routed = moe.count * 3 * h * moe.ffn, moe.topk * 3 * h * moe.ffn
    else:
        mlp, replicated, routed, active_routed = 3 * h * sizes["ffn_hidden_size"], norms, 0, 0
    embedding = padded_vocab * h
    tied = hf.get("tie_word_embeddings", False)
    total = layers * (attn + mlp + replicated + routed) + h + embedding * (1 if tied else 2)
    # first stage: its layers, the embedding; with PP = 1 also the output layer (when untied) and final norm
    experts_on_rank = layers / pp * routed / (tp * ep)
    on_rank = layers / pp * ((attn + mlp) / tp + replicated) + experts_on_rank + embedding / tp
    if pp == 1:
        on_rank += h + (0 if tied else embedding / tp)
    return Shard(total=total, on_rank=on_rank, experts_on_rank=experts_on_rank,
                 active=total - layers * (routed - active_routed))
