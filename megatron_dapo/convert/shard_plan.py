"""Dry run: what each (PP stage, TP rank) of a converted model holds, computed on meta tensors.

Runs the real mapping code (``to_megatron`` + ``tp_split``) on ``device="meta"`` tensors, so a
32B plan at TP=8 PP=2 allocates nothing. Layers are split evenly over stages, as Megatron does
without ``account_for_embedding_in_pipeline_split``; stage 0 holds the embedding, the last stage
the final norm and output layer (with tied embeddings and PP > 1 the last stage holds a copy of
the embedding as its output layer, which Megatron keeps in sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dapo.convert.table import ConversionTable, conversion_table


@dataclass
class RankShard:
    pp_rank: int
    tp_rank: int
    num_params: int = 0
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _stage_of(table: ConversionTable, megatron_name: str, layer: int | None, pp: int) -> int:
    if layer is not None:
        return layer // (table.dims.num_layers // pp)
    return 0 if megatron_name.startswith("embedding.") else pp - 1


def shard_plan(config: dict[str, Any], *, tp: int, pp: int, padded_vocab_size: int | None = None,
               spec: str = "local") -> list[RankShard]:
    """One ``RankShard`` per (pp_rank, tp_rank), with the local shape of every Megatron tensor."""
    table = conversion_table(config, padded_vocab_size=padded_vocab_size)
    table.check_parallel(tp, pp)
    ranks = {(p, t): RankShard(p, t) for p in range(pp) for t in range(tp)}
    placed = [(task, task.megatron_name(spec)) for task in table.tasks]
    if table.dims.tie_word_embeddings and pp > 1:
        emb = next(task for task, name in placed if name == "embedding.word_embeddings.weight")
        placed.append((emb, "output_layer.weight"))
    for task, name in placed:
        metas = [torch.empty(s, device="meta") for s in task.mapping.hf_shapes(table.dims)]
        full = task.mapping.to_megatron(metas, table.dims)
        stage = pp - 1 if name == "output_layer.weight" else _stage_of(table, name, task.layer, pp)
        for tp_rank, shard in enumerate(task.mapping.tp_split(full, tp)):
            r = ranks[(stage, tp_rank)]
            r.tensors[name] = tuple(shard.shape)
            r.num_params += shard.numel()
    return list(ranks.values())


def format_shard_plan(rows: list[RankShard], *, bytes_per_param: int = 2) -> str:
    lines = [f"{'pp':>3} {'tp':>3} {'tensors':>8} {'params':>15} {'GiB':>8}"]
    for r in rows:
        gib = r.num_params * bytes_per_param / 2**30
        lines.append(f"{r.pp_rank:>3} {r.tp_rank:>3} {len(r.tensors):>8} {r.num_params:>15,} {gib:>8.3f}")
    total = sum(r.num_params for r in rows)
    lines.append(f"sum over ranks: {total:,} params ({total * bytes_per_param / 2**30:.2f} GiB at "
                 f"{bytes_per_param} bytes/param; norms, replicated, counted on every TP rank)")
    return "\n".join(lines)
