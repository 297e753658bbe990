"""Parameter mapping types for HF <-> Megatron-Core conversion. Pure torch: no megatron import.

A mapping ties the HF tensor(s) of one logical parameter to one Megatron parameter and knows:
  * how to build the full (TP=1) Megatron tensor from the HF tensors and back (``to_megatron`` /
    ``to_hf``); both directions are pure re-layouts, so a round trip is bit-exact;
  * how Megatron shards that tensor over tensor-parallel ranks (``tp_split`` / ``tp_merge``):
    column-parallel layers along dim 0, row-parallel layers along dim 1, norms replicated;
  * the shape every HF tensor must have (``hf_shapes``), so a misshapen checkpoint fails with
    the tensor's name and the expectation instead of deep inside a copy.

Names are patterns: one ``*`` stands for the (global) decoder layer index and, in a mixture-of-experts
layer, one ``@`` for the (global) expert index.

Megatron layouts, from megatron/core (0.19.2):
  * fused QKV (``SelfAttention.get_query_key_value_tensors``): rows are grouped per KV group,
    ``[q_0 .. q_{n-1}, k, v]`` with n = heads / groups, each block ``head_dim`` rows; weights
    and biases alike. TP splits the fused rows contiguously (ColumnParallelLinear): whole groups
    per rank when TP divides the groups; when TP is a multiple of the groups, attention
    all-gathers the rows and picks its group (attention.py, num_query_groups < world_size).
  * fused gate/up ``linear_fc1`` (``transformer/mlp.py``): the full tensor is ``[gate; up]``,
    but TP rank r holds ``[gate_r; up_r]``, not a contiguous slice of the full tensor.
  * vocabulary: ``VocabParallelEmbedding`` and the output layer may carry padding rows past
    the HF vocabulary; they are zero-filled on import and dropped on export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor


class ConversionError(ValueError):
    """A checkpoint or config that does not fit the conversion table; the message says why."""


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The sizes a conversion table needs, read from an HF config (see ``from_sizes``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    moe_ffn_hidden_size: int = 0  # one expert's intermediate size

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                  f"num_key_value_heads={self.num_query_groups}")
        if self.padded_vocab_size < self.vocab_size:
            raise ConversionError(f"padded_vocab_size={self.padded_vocab_size} < "
                                  f"vocab_size={self.vocab_size}")

    @classmethod
    def from_sizes(cls, sizes: dict[str, Any], *, padded_vocab_size: int | None = None) -> "ModelDims":
        """Dims from ``hf_sizes``' reading of a config (table.model_sizes: with its architecture's experts)."""
        return cls(num_layers=sizes["num_layers"], hidden_size=sizes["hidden_size"],
                   num_attention_heads=sizes["num_attention_heads"], num_query_groups=sizes["num_query_groups"],
                   head_dim=sizes["kv_channels"], ffn_hidden_size=sizes["ffn_hidden_size"],
                   vocab_size=sizes["vocab_size"], padded_vocab_size=padded_vocab_size or sizes["vocab_size"],
                   tie_word_embeddings=sizes["tie_word_embeddings"], num_experts=sizes["num_moe_experts"],
                   moe_ffn_hidden_size=sizes["moe_ffn_hidden_size"])

    def size(self, symbol: str) -> int:
        """Resolve a symbolic dimension used by the tables' ``shape`` tuples."""
        sizes = {"hidden": self.hidden_size, "ffn": self.ffn_hidden_size, "vocab": self.vocab_size,
                 "q": self.num_attention_heads * self.head_dim, "kv": self.num_query_groups * self.head_dim,
                 "head": self.head_dim, "experts": self.num_experts, "moe_ffn": self.moe_ffn_hidden_size}
        return sizes[symbol]


_HF_SIZE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def hf_sizes(config: dict[str, Any], *, experts: bool = True) -> dict[str, Any]:
    """The sizes in a Llama-like HF config dict, under Megatron's names: the package's one reader of
    them (table.model_sizes tells it whether the architecture has experts; mcore.model.hf_arch adds the
    architecture's checks and the rest of the model). ``experts=False``: 0 experts, whatever a stray
    num_experts in a dense config.json says."""
    missing = [k for k in _HF_SIZE_KEYS if config.get(k) is None]
    if missing:
        raise ConversionError(f"HF config lacks {missing}, needed for {config.get('architectures')}")
    heads = config["num_attention_heads"]
    return {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
            "num_attention_heads": heads,
            "num_query_groups": config.get("num_key_value_heads") or heads,  # absent means plain MHA
            "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
            "ffn_hidden_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            # Qwen3-MoE: routed experts (none shared) of moe_intermediate_size each; the released
            # config.json files say num_experts, transformers >= 5 writes num_local_experts
            "num_moe_experts": int(config.get("num_experts") or config.get("num_local_experts") or 0)
            if experts else 0,
            "moe_ffn_hidden_size": int(config.get("moe_intermediate_size") or 0) if experts else 0}


def _fill(pattern: str, layer: int | None, expert: int | None = None) -> str:
    if layer is not None:
        pattern = pattern.replace("*", str(layer))
    return pattern if expert is None else pattern.replace("@", str(expert))


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter <-> an ordered tuple of HF tensors. Subclasses define the layout.

    ``megatron`` is the local-spec name; ``te`` the Transformer Engine spec name where it differs
    (TE fuses the pre-attention and pre-MLP norms into linear_qkv / linear_fc1).
    ``tp_axis``: 0 = column parallel, 1 = row parallel, None = replicated on every TP rank.
    """

    megatron: str
    hf: tuple[str, ...]
    tp_axis: int | None
    te: str | None = None

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "@" in self.megatron

    def megatron_name(self, layer: int | None, spec: str = "local", expert: int | None = None) -> str:
        return _fill(self.te if spec == "te" and self.te else self.megatron, layer, expert)

    def hf_names(self, layer: int | None, expert: int | None = None) -> list[str]:
        return [_fill(p, layer, expert) for p in self.hf]

    # -- layout: subclasses override -------------------------------------------------------
    def hf_shapes(self, dims: ModelDims) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> Tensor:
        raise NotImplementedError

    def to_hf(self, full: Tensor, dims: ModelDims) -> list[Tensor]:
        raise NotImplementedError

    # -- tensor parallelism ----------------------------------------------------------------
    def tp_split(self, full: Tensor, tp_size: int) -> list[Tensor]:
        """Full tensor -> the shard of each TP rank (views where possible)."""
        if self.tp_axis is None:
            return [full] * tp_size
        if full.shape[self.tp_axis] % tp_size:
            raise ConversionError(f"{self.megatron}: dim {self.tp_axis} of shape {tuple(full.shape)} "
                                  f"is not divisible by TP={tp_size}")
        return list(torch.chunk(full, tp_size, dim=self.tp_axis))

    def tp_shard_rows(self, hf: Sequence[Tensor], dims: ModelDims, tp_size: int, tp_rank: int) -> list[Tensor]:
        """TP rank ``tp_rank``'s shard of ``to_megatron(hf)`` as row blocks (dim 0) whose
        concatenation is the shard: a mapping whose shard is several HF tensors side by side (fc1's
        [gate_r; up_r]) gives them as they are, so a caller writing the shard part by part copies none."""
        return [self.tp_split(self.to_megatron(hf, dims), tp_size)[tp_rank]]

    def tp_merge(self, shards: Sequence[Tensor]) -> Tensor:
        """Inverse of ``tp_split``; replicated tensors are taken from rank 0."""
        if self.tp_axis is None:
            return shards[0]
        return shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=self.tp_axis)

    def tp_merged_shape(self, shard_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        """The shape ``tp_merge`` gives for ``tp_size`` shards of ``shard_shape``, by arithmetic:
        the same on meta tensors would import torch._dynamo (torch.cat's meta kernel), about 1 s."""
        shape = list(shard_shape)
        if self.tp_axis is not None:
            shape[self.tp_axis] *= tp_size
        return tuple(shape)


@dataclass(frozen=True)
class Direct(ParamMapping):
    """1:1 rename. ``shape`` uses the symbols of ``ModelDims.size`` (e.g. ("hidden", "ffn"))."""

    shape: tuple[str, ...] = ()

    def hf_shapes(self, dims):
        return [tuple(dims.size(s) for s in self.shape)]

    def to_megatron(self, hf, dims):
        return hf[0]

    def to_hf(self, full, dims):
        return [full]


def replicated(megatron: str, hf: str, *, te: str | None = None, shape: tuple[str, ...] = ("hidden",)) -> Direct:
    """A norm weight: same on every TP rank (``shape``: over the hidden size, or ("head",) for a
    per-head query / key norm)."""
    return Direct(megatron, (hf,), None, te, shape=shape)


def row_parallel(megatron: str, hf: str, *, shape: tuple[str, str]) -> Direct:
    """A RowParallelLinear weight [out, in]: TP splits the input dim (1)."""
    return Direct(megatron, (hf,), 1, shape=shape)


@dataclass(frozen=True)
class VocabParallel(ParamMapping):
    """Embedding or output-layer weight [vocab, hidden], split over TP along the vocabulary.

    Megatron's vocabulary may be padded (to a multiple that keeps TP shards even); padding
    rows are zeros on import and are dropped on export.
    """

    def hf_shapes(self, dims):
        return [(dims.vocab_size, dims.hidden_size)]

    def to_megatron(self, hf, dims):
        (w,) = hf
        pad = dims.padded_vocab_size - w.shape[0]
        if pad == 0:
            return w
        return torch.cat([w, w.new_zeros((pad,) + tuple(w.shape[1:]))], dim=0)

    def to_hf(self, full, dims):
        return [full[: dims.vocab_size]]


def vocab_parallel(megatron: str, hf: str) -> VocabParallel:
    return VocabParallel(megatron, (hf,), 0)


@dataclass(frozen=True)
class FusedQKV(ParamMapping):
    """q, k, v projections (weight [rows, hidden] or bias [rows]) <-> Megatron's fused
    ``linear_qkv``, interleaved per KV group as ``[q x heads/groups, k, v]`` (module docstring)."""

    def hf_shapes(self, dims):
        tail = () if self.megatron.endswith(".bias") else (dims.hidden_size,)
        return [(dims.size("q"),) + tail, (dims.size("kv"),) + tail, (dims.size("kv"),) + tail]

    def to_megatron(self, hf, dims):
        q, k, v = hf
        g, d = dims.num_query_groups, dims.head_dim
        tail = tuple(q.shape[1:])
        per_group = [q.reshape((g, -1, d) + tail), k.reshape((g, 1, d) + tail), v.reshape((g, 1, d) + tail)]
        return torch.cat(per_group, dim=1).reshape((-1,) + tail)

    def to_hf(self, full, dims):
        g, d = dims.num_query_groups, dims.head_dim
        n = dims.num_attention_heads // g
        tail = tuple(full.shape[1:])
        grouped = full.reshape((g, n + 2, d) + tail)
        q, k, v = torch.split(grouped, [n, 1, 1], dim=1)
        return [t.reshape((-1,) + tail) for t in (q, k, v)]


def fused_qkv(megatron: str, *, q: str, k: str, v: str) -> FusedQKV:
    return FusedQKV(megatron, (q, k, v), 0)


@dataclass(frozen=True)
class GatedMLP(ParamMapping):
    """gate_proj and up_proj [ffn, hidden] <-> ``linear_fc1`` = [gate; up] (column parallel).

    TP rank r holds [gate_r; up_r]: split gate and up separately, then stack per rank.
    ``ffn``: the symbol of its intermediate size ("moe_ffn" for one expert of an MoE layer).
    """

    ffn: str = "ffn"

    def hf_shapes(self, dims):
        return [(dims.size(self.ffn), dims.hidden_size)] * 2

    def to_megatron(self, hf, dims):
        return torch.cat(list(hf), dim=0)

    def to_hf(self, full, dims):
        return list(torch.chunk(full, 2, dim=0))

    def tp_split(self, full, tp_size):
        gate, up = torch.chunk(full, 2, dim=0)
        if gate.shape[0] % tp_size:
            raise ConversionError(f"{self.megatron}: ffn size {gate.shape[0]} is not divisible by "
                                  f"TP={tp_size}")
        pairs = zip(torch.chunk(gate, tp_size), torch.chunk(up, tp_size))
        return [torch.cat([g, u], dim=0) for g, u in pairs]

    def tp_shard_rows(self, hf, dims, tp_size, tp_rank):
        gate, up = hf
        if gate.shape[0] % tp_size:
            raise ConversionError(f"{self.megatron}: ffn size {gate.shape[0]} is not divisible by "
                                  f"TP={tp_size}")
        return [torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]]

    def tp_merge(self, shards):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def gated_mlp(megatron: str, *, gate: str, up: str, ffn: str = "ffn") -> GatedMLP:
    return GatedMLP(megatron, (gate, up), 0, ffn=ffn)
