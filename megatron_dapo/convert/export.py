"""Move weights between a live TP/PP-sharded Megatron model and HF names, one tensor or bucket at a time.

``export_hf_weights`` yields ``(hf_name, full tensor)`` from the model chunks this rank holds: each
tensor is all-gathered inside its TP group and broadcast from the pipeline stage that owns it, so
every rank sees every tensor (as Megatron-Bridge's ``export_hf_weights`` does). Transfers go in
buckets of at most ``bucket_bytes``: memory holds one bucket of full tensors at a time, and the
consumer (a safetensors writer, a rollout engine's weight loader) must be done with a bucket's
tensors before it asks for the next one. ``load_hf_weights`` is the inverse: each rank reads the
HF tensors its own parameters need and keeps its TP shard.

Pure torch.distributed: the caller passes the TP and PP process groups (None = not parallel), and
nothing here imports megatron. The model chunks are megatron GPTModels, possibly wrapped (DDP,
Float16Module: anything with ``.module``); with virtual pipelining a rank holds several chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_dapo import ranks
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.packing import pack_consecutive
from megatron_dapo.convert.safetensors_io import SafetensorsReader
from megatron_dapo.convert.table import ConversionTable, Task

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
DEFAULT_BUCKET_BYTES = 512 * 2**20


def unwrap(module: nn.Module) -> nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def local_parameters(model_chunks: Sequence[nn.Module], table: ConversionTable,
                     ep_group=None) -> dict[int, tuple[str, Tensor]]:
    """This rank's parameters as {task index: (global Megatron name, local TP shard)}.

    Layer indices in ``named_parameters`` are local to a chunk; ``layer_number`` (1-based) is global.
    Expert indices are local to an expert-parallel rank (``ep_group``): rank r of EP holds the
    experts r x E / EP .. (r + 1) x E / EP - 1, as megatron's SequentialMLP numbers them.
    """
    index = {id(t): i for i, t in enumerate(table.tasks)}
    local_experts = table.dims.num_experts // _size(ep_group)
    out: dict[int, tuple[str, Tensor]] = {}
    for chunk in map(unwrap, model_chunks):
        for name, param in chunk.named_parameters():
            if name == "output_layer.weight" and table.dims.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding: exported once, from stage 0
            m = _LAYER.match(name)
            if m:
                rest = m[2]
                if e := _LOCAL_EXPERT.match(rest):
                    rest = f"{e[1]}{_rank(ep_group) * local_experts + int(e[2])}{e[3]}"
                name = f"decoder.layers.{chunk.decoder.layers[int(m[1])].layer_number - 1}.{rest}"
            task = table.task_for_megatron(name)
            out[index[id(task)]] = (name, param)
    return out


@dataclass(frozen=True)
class _Item:
    task_index: int
    owner: int  # global rank of the owning stage's member of this rank's PP group
    name: str
    shard_shape: tuple[int, ...]  # a TP rank's
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _plan(table: ConversionTable, local: dict[int, tuple[str, Tensor]], tp_group, pp_group, ep_group,
          wire_dtype: torch.dtype | None) -> list[_Item]:
    """Every rank of the PP group agrees on the same ordered list of tensors and owners. Under expert
    parallelism every rank of a stage owns all of its experts: it receives those of the other EP ranks
    (``_expert_shard``) before the stage's broadcast."""
    tp = _size(tp_group)
    me = ranks.rank()
    mine = [(i, me, name, tuple(p.shape), wire_dtype or p.dtype) for i, (name, p) in local.items()]
    if _size(ep_group) > 1:
        peers = [None] * _size(ep_group)
        dist.all_gather_object(peers, mine, group=ep_group)
        have = {row[0] for row in mine}
        mine += list({i: (i, me, *rest) for rows in peers for i, _, *rest in rows if i not in have}.values())
    gathered = [mine]
    if _size(pp_group) > 1:
        gathered = [None] * _size(pp_group)
        dist.all_gather_object(gathered, mine, group=pp_group)
    owners = {row[0]: row for rows in gathered for row in rows}  # a stage's TP peers agree on shapes
    missing = [t.megatron_name() for i, t in enumerate(table.tasks) if i not in owners]
    if missing:
        raise ConversionError(f"model lacks Megatron parameters {missing[:8]} that the {table.architecture} "
                              f"table expects (checked across {_size(pp_group)} pipeline stage(s))")
    items = []
    for i in sorted(owners):
        _, owner, name, shape, dtype = owners[i]
        full = table.tasks[i].mapping.tp_merged_shape(shape, tp)
        items.append(_Item(i, owner, name, shape, full, dtype, torch.Size(full).numel() * dtype.itemsize))
    return items


def _buckets(items: list[_Item], bucket_bytes: int) -> list[list[_Item]]:
    """Consecutive items with the same owner and dtype, up to ``bucket_bytes`` (at least one item)."""
    return pack_consecutive(items, lambda item: item.nbytes, bucket_bytes,
                            same=lambda first, item: (item.owner, item.dtype) == (first.owner, first.dtype))


def _expert_shard(table: ConversionTable, item: _Item, local: dict[int, tuple[str, Tensor]], ep_group,
                  device) -> Tensor:
    """This TP rank's shard of an expert's weight, from the EP rank that holds the expert (a broadcast
    over the EP group, every member of which asks for the same item at the same point of the plan)."""
    holder = table.tasks[item.task_index].expert // (table.dims.num_experts // _size(ep_group))
    if item.task_index in local:
        shard = local[item.task_index][1].detach().to(item.dtype).contiguous()
    else:
        shard = torch.empty(item.shard_shape, dtype=item.dtype, device=device)
    dist.broadcast(shard, src=dist.get_global_rank(ep_group, holder), group=ep_group)
    return shard


def _gather_tp(task: Task, shard: Tensor, tp_group) -> Tensor:
    tp = _size(tp_group)
    if tp == 1 or task.mapping.tp_axis is None:
        return shard.detach()
    pieces = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(pieces, shard.detach().contiguous(), group=tp_group)
    return task.mapping.tp_merge(pieces)


@torch.no_grad()
def export_hf_weights(model_chunks: Sequence[nn.Module], table: ConversionTable, *, tp_group=None,
                      pp_group=None, ep_group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield every HF tensor of the model, full size, on every rank of the TP x PP grid.

    Every rank of the model-parallel group must consume the whole iterator (it runs collectives).
    ``device``: where yielded tensors live (e.g. "cpu" to write files); default: the params' device.
    ``dtype``: cast to this dtype (before the PP broadcast, which then moves fewer, larger buckets);
    default: each param's own (megatron's local-spec norms stay fp32 in a bf16 model).
    At TP = PP = 1 a yielded tensor may be the parameter itself: read it, do not modify it.
    """
    local = local_parameters(model_chunks, table, ep_group)
    me = ranks.rank()
    pp_size = _size(pp_group)
    param_device = next(iter(local.values()))[1].device

    def shard(b: _Item) -> Tensor:  # this rank's TP shard of an item of its own stage
        if _size(ep_group) > 1 and table.tasks[b.task_index].expert is not None:
            return _expert_shard(table, b, local, ep_group, param_device)
        return local[b.task_index][1]

    for bucket in _buckets(_plan(table, local, tp_group, pp_group, ep_group, dtype), bucket_bytes):
        owner = bucket[0].owner == me
        if pp_size == 1:
            fulls = [_gather_tp(table.tasks[b.task_index], shard(b), tp_group).to(b.dtype) for b in bucket]
        else:
            # One broadcast per bucket from the owning stage. The owner gathers each tensor over
            # TP straight into its slot of the flat buffer, so it holds one bucket plus one tensor.
            sizes = [torch.Size(b.full_shape).numel() for b in bucket]
            flat = torch.empty(sum(sizes), dtype=bucket[0].dtype, device=param_device)
            fulls = [p.view(b.full_shape) for p, b in zip(torch.split(flat, sizes), bucket)]
            if owner:
                for b, slot in zip(bucket, fulls):
                    slot.copy_(_gather_tp(table.tasks[b.task_index], shard(b), tp_group))
            dist.broadcast(flat, src=bucket[0].owner, group=pp_group)
            del flat
        for b, full in zip(bucket, fulls):
            task = table.tasks[b.task_index]
            for hf_name, t in zip(task.hf_names, task.mapping.to_hf(full, table.dims)):
                yield hf_name, t.to(device=device, dtype=dtype)
        del fulls


def check_hf_checkpoint(table: ConversionTable, reader: SafetensorsReader) -> None:
    """Exactly the table's HF names, each of the shape the config implies (headers only)."""
    names = reader.names()
    table.check_names(names)
    for name in names:
        table.check_hf_shape(name, reader.shape(name))


def hf_targets(model_chunks: Sequence[nn.Module], table: ConversionTable,
               ep_group=None) -> dict[str, tuple[Task, Tensor]]:
    """This rank's parameters as {global Megatron name: (task, parameter)}, in the table's order;
    with tied embeddings, a last stage's output-layer copy maps to the embedding's task."""
    local = sorted(local_parameters(model_chunks, table, ep_group).items())
    targets = {name: (table.tasks[i], p) for i, (name, p) in local}
    if table.dims.tie_word_embeddings:
        for chunk in map(unwrap, model_chunks):
            out = getattr(getattr(chunk, "output_layer", None), "weight", None)
            if out is not None:
                embedding = table.task_for_megatron("embedding.word_embeddings.weight")
                targets["output_layer.weight"] = (embedding, out)
    return targets


def hf_shard_rows(table: ConversionTable, megatron_name: str, task: Task, param: Tensor,
                  reader: SafetensorsReader, *, tp_size: int, tp_rank: int) -> list[Tensor]:
    """The value ``param`` (this rank's TP shard of ``megatron_name``) takes from the HF checkpoint, in
    the parameter's dtype, as row blocks whose concatenation is that value
    (``ParamMapping.tp_shard_rows``): views of the tensors just read where the layout allows (fc1's
    gate and up halves), so that no caller needs a concatenated copy."""
    rows = task.mapping.tp_shard_rows([reader.get(n, param.dtype) for n in task.hf_names], table.dims,
                                      tp_size, tp_rank)
    shape = (sum(r.shape[0] for r in rows),) + tuple(rows[0].shape[1:])
    if shape != tuple(param.shape) or any(tuple(r.shape[1:]) != shape[1:] for r in rows):
        raise ConversionError(f"{megatron_name}: converted TP shard has shape {shape}, the "
                              f"model's parameter {tuple(param.shape)} (model built from another config "
                              f"or with another vocabulary padding?)")
    return rows


@torch.no_grad()
def load_hf_weights(model_chunks: Sequence[nn.Module], table: ConversionTable, reader: SafetensorsReader, *,
                    tp_group=None, ep_group=None, progress=None) -> int:
    """Copy an HF checkpoint into this rank's parameters (its TP shard of its stages' tensors; of an
    MoE layer's experts, those of its EP rank).

    Checks the whole checkpoint's names and shapes first (headers only). ``progress``: an optional
    callable run once per loaded parameter (e.g. a tqdm ``update``). Returns the parameters loaded.
    """
    check_hf_checkpoint(table, reader)
    targets = hf_targets(model_chunks, table, ep_group)
    for megatron_name, (task, param) in targets.items():
        rows = hf_shard_rows(table, megatron_name, task, param, reader, tp_size=_size(tp_group),
                             tp_rank=_rank(tp_group))
        for part, row in zip(param.split([r.shape[0] for r in rows]), rows, strict=True):
            part.copy_(row)
        if progress is not None:
            progress()
    return len(targets)
