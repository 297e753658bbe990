"""Megatron -> HF model dir: ``megatron_to_hf`` (a checkpoint written by ``hf_to_megatron``) and
``write_hf_checkpoint`` (a live, possibly sharded model, e.g. a training run's export).

Kept apart from the other direction (hf_to_mcore.py), with which it shares only
converted_checkpoint.py: it works through megatron's loader, asked for one bucket's regions at a
time, and through convert.export's gather of a live model.

Memory: ``megatron_to_hf`` in one process asks megatron's loader for ``bucket_bytes`` of parameters
at a time and writes each HF tensor straight into its output file (``stream_checkpoint_to_hf``,
also a one-process ``megatron-dapo export`` of a training checkpoint: mcore/run_export.py);
under torchrun each rank loads its shard of the model and rank 0 writes what ``export_hf_weights``
gathers (one bucket, one output shard).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import ranks
from megatron_dapo.convert.export import DEFAULT_BUCKET_BYTES, export_hf_weights, hf_targets, unwrap
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.packing import pack_consecutive
from megatron_dapo.convert.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardedSafetensorsWriter,
    StreamingSafetensorsWriter,
    copy_side_files,
    plan_shards,
)
from megatron_dapo.convert.table import ConversionTable
from megatron_dapo.mcore.converted_checkpoint import (
    DTYPES,
    HF_SUBDIR,
    check_out_dir,
    checkpoint_model,
    load_into,
    prepare_out_dir,
    read_checkpoint_meta,
)
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
from megatron_dapo.mcore.dcp_in_place import records_read_in_place

_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# megatron_to_hf: parameters read from the checkpoint (or gathered over TP / PP) per step. Memory
# holds one bucket plus megatron's loader's copy of one tensor; a larger tensor is a bucket alone.
CONVERT_BUCKET_BYTES = 256 * 2**20


def _hf_layout(table: ConversionTable, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every HF tensor as (name, shape, dtype), in the order export_hf_weights yields them."""
    return [(name, tuple(shape), dtype) for task in table.tasks
            for name, shape in zip(task.hf_names, task.mapping.hf_shapes(table.dims))]


def _finish_hf_dir(out_dir: Path, hf_config: dict[str, Any], side_files_from,
                   written: torch.dtype | None) -> None:
    """The side files and config.json next to the written weights."""
    if side_files_from is not None:
        copy_side_files(side_files_from, out_dir)
    config = {k: v for k, v in hf_config.items() if k != "torch_dtype"}
    config["dtype"] = _HF_DTYPE_NAMES.get(written, str(written).removeprefix("torch."))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_hf_checkpoint(chunks, table: ConversionTable, out_dir: str | os.PathLike, *,
                        hf_config: dict[str, Any], side_files_from: str | os.PathLike | None = None,
                        tp_group=None, pp_group=None, ep_group=None, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, progress: bool = True) -> list[Path]:
    """Stream a live (possibly sharded) model into an HF dir; rank 0 writes, every rank must call.

    ``dtype``: of the written tensors; default: each parameter's own. Given, every tensor's shape
    and dtype are known up front and each goes straight to its file (StreamingSafetensorsWriter)."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    writer = None
    if ranks.rank() == 0:
        writer = (ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes) if dtype is None
                  else StreamingSafetensorsWriter(out_dir, _hf_layout(table, dtype),
                                                  max_shard_bytes=max_shard_bytes))
    written = dtype
    stream = export_hf_weights(chunks, table, tp_group=tp_group, pp_group=pp_group, ep_group=ep_group,
                               bucket_bytes=bucket_bytes, device="cpu", dtype=dtype)
    for name, tensor in tqdm(stream, total=len(table.hf_names()), desc="Megatron -> HF", unit="tensor",
                             disable=not progress or ranks.rank() != 0):
        if writer is not None:
            writer.add(name, tensor)
            written = written or tensor.dtype
    if writer is not None:
        files = writer.close()
        _finish_hf_dir(out_dir, hf_config, side_files_from, written)
        return files
    return []


def _aligned(nbytes: int, alignment: int = 64) -> int:
    return -(-nbytes // alignment) * alignment


def _region_requests(entry, buffer: torch.Tensor) -> list:
    """ShardedTensors that load ``buffer`` (fresh, of the parameter's shape) from the regions of the
    checkpoint's global tensors that ``entry`` (the parameter's sharded_state_dict entry, a
    ShardedTensor or a factory such as fc1's) maps it to. The layer axis megatron prepends is
    folded into the local shape: in that form (an irregular grid to megatron) any subset of
    layers loads in one process, where the prepended form asks for the whole grid of layers."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    built = dataclasses.replace(entry, data=buffer)
    if isinstance(built, ShardedTensorFactory):
        built = built.build()  # views of buffer (fc1: its gate and up halves)
    requests = []
    for part in nested_values(built) if isinstance(built, (dict, list)) else [built]:
        if not isinstance(part, ShardedTensor) or part.flattened_range is not None:
            raise ConversionError(f"{entry.key}: cannot stream {type(part).__name__} entries")
        local_shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
        requests.append(ShardedTensor(part.key, part.data.view(local_shape), part.dtype, local_shape,
                                      part.global_shape, part.global_offset, None))
    return requests


def _stream_layout(table: ConversionTable, targets: dict, dtype: torch.dtype | None
                   ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``_hf_layout``, each tensor of its parameter's dtype where ``dtype`` is None (as
    export_hf_weights yields them then)."""
    if dtype is not None:
        return _hf_layout(table, dtype)
    own = {id(task): param.dtype for task, param in targets.values()}
    missing = [task.megatron_name() for task in table.tasks if id(task) not in own]
    if missing:
        raise ConversionError(f"model lacks Megatron parameters {missing[:8]} that the {table.architecture} "
                              "table expects")
    return [(name, tuple(shape), own[id(task)]) for task in table.tasks
            for name, shape in zip(task.hf_names, task.mapping.hf_shapes(table.dims))]


def stream_checkpoint_to_hf(model, table: ConversionTable, ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike,
                            *, hf_config: dict[str, Any], side_files_from: str | os.PathLike | None,
                            dtype: torch.dtype | None, sharded: dict | None = None,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            bucket_bytes: int = CONVERT_BUCKET_BYTES, progress: bool = True,
                            part: int = 0, parts: int = 1) -> list[Path]:
    """One process: read the checkpoint a bucket of parameters at a time (megatron's loader, asked
    for just those parameters' regions, into one reused arena) and write each HF tensor straight
    to its file. Memory: one bucket, not the model (``model``'s weights stay untouched).

    The files are ``write_hf_checkpoint``'s on the loaded model, byte for byte: ``dtype`` given,
    every tensor cast to it, in the table's order; None, each of its parameter's dtype, laid out
    as ``ShardedSafetensorsWriter`` lays them out, config.json's dtype the first tensor's.
    ``sharded``: the model's ``sharded_state_dict()`` as the checkpoint was saved (the parameters'
    entries, keyed by module name; default: the model's own, which is what ``hf_to_megatron``
    saved); a training checkpoint's is mcore/checkpoint.py's ``model_sharded_state_dict``.

    ``part`` of ``parts``: only the output shards of that part (StreamingSafetensorsWriter), from the
    parameters they need; the caller names the shards and finishes the dir once every part is done."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    model = unwrap(model)
    sharded = model.sharded_state_dict() if sharded is None else sharded
    every = hf_targets([model], table)
    layout = _stream_layout(table, every, dtype)
    cast = {name: dt for name, _, dt in layout}
    writer = StreamingSafetensorsWriter(out_dir, layout, max_shard_bytes=max_shard_bytes, part=part, parts=parts,
                                        as_save_file=dtype is None)
    targets = {name: (task, param) for name, (task, param) in every.items() if any(map(writer.wants, task.hf_names))}
    if not targets:  # more parts than output shards
        return writer.close()
    buckets = pack_consecutive(list(targets), lambda name: targets[name][1].nbytes, bucket_bytes)
    # One arena for every bucket: fresh buffers per bucket would page-fault all of their memory again
    arena_bytes = max(sum(_aligned(targets[name][1].nbytes) for name in bucket) for bucket in buckets)
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=next(iter(targets.values()))[1].device)
    total = sum(map(writer.wants, table.hf_names()))
    with tqdm(total=total, desc="Megatron -> HF", unit="tensor", disable=not progress) as bar, \
            records_read_in_place():
        for bucket in buckets:
            buffers, offset = {}, 0
            for name in bucket:
                param = targets[name][1]
                buffers[name] = arena[offset:offset + param.nbytes].view(param.dtype).view(param.shape)
                offset += _aligned(param.nbytes)
            regions = [r for name in bucket for r in _region_requests(sharded[name], buffers[name])]
            request = {str(i): r for i, r in enumerate(regions)}
            # A part of the checkpoint: "every shard accessed exactly once" (validate_access_integrity)
            # holds only for all of it; each region's global shape is still checked.
            loaded = dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)
            for key, r in request.items():
                if loaded[key].data_ptr() != r.data.data_ptr():  # torch DCP loads in place; if not, copy
                    r.data.copy_(loaded[key])
            del loaded, request, regions
            for name in bucket:
                task = targets[name][0]
                for hf_name, tensor in zip(task.hf_names, task.mapping.to_hf(buffers.pop(name), table.dims)):
                    if writer.wants(hf_name):
                        writer.add(hf_name, tensor.to(cast[hf_name]))
                        bar.update()
    files = writer.close()
    if parts == 1:
        _finish_hf_dir(out_dir, hf_config, side_files_from, dtype or (layout[0][2] if layout else None))
    return files


def default_workers(num_shards: int) -> int:
    """Processes for a one-process conversion when none is asked for: one per four cores (each
    process's reads and writes leave the core to the kernel half the time; the node's other work
    keeps some), at most one per output shard and at most 8 (each holds a bucket and the largest
    tensor)."""
    return max(1, min(num_shards, (os.cpu_count() or 1) // 4, 8))


def _stream_part(ckpt_dir: Path, out_dir: Path, dtype: torch.dtype, max_shard_bytes: int, bucket_bytes: int,
                 part: int, parts: int) -> None:
    """A worker process's part of ``megatron_to_hf`` (spawned: a fresh interpreter, its own
    one-process group)."""
    apply_cpu_compat()
    chunks, table, _, _, _ = checkpoint_model(ckpt_dir, tp=1, pp=1)
    stream_checkpoint_to_hf(chunks[0], table, ckpt_dir, out_dir, hf_config={}, side_files_from=None, dtype=dtype,
                             max_shard_bytes=max_shard_bytes, bucket_bytes=bucket_bytes, progress=False,
                             part=part, parts=parts)


def _spawn_parts(ckpt_dir: Path, out_dir: Path, *, dtype: torch.dtype, max_shard_bytes: int, bucket_bytes: int,
                 workers: int) -> list:
    """Parts 1 .. workers - 1 of the output, each in a process of its own (part 0 is the caller's)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    others = [spawn.Process(target=_stream_part, name=f"megatron_to_hf part {k}",
                            args=(ckpt_dir, out_dir, dtype, max_shard_bytes, bucket_bytes, k, workers))
              for k in range(1, workers)]
    for process in others:
        process.start()
    return others


def _join_parts(others: list, layout, out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """Waits for the spawned parts; every part's shards named and the index written once all are in."""
    for process in others:
        process.join()
    failed = [p.name for p in others if p.exitcode != 0]
    if failed:
        raise ConversionError(f"{', '.join(failed)} failed (its error is above); {out_dir} is incomplete")
    return StreamingSafetensorsWriter(out_dir, layout, max_shard_bytes=max_shard_bytes, parts=len(others) + 1
                                      ).name_parts()


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                   tp: int = 1, pp: int = 1, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   bucket_bytes: int = CONVERT_BUCKET_BYTES, force: bool = False,
                   progress: bool = True, workers: int | None = None) -> list[Path]:
    """Convert a checkpoint written by ``hf_to_megatron`` to an HF dir; ``dtype`` defaults to the
    checkpoint's (local-spec norms are fp32 even in a bf16 model, and are cast back).

    Launched as one process it streams the checkpoint a bucket at a time, in ``workers`` processes
    side by side (each writing every ``workers``-th output shard; default: ``default_workers``);
    under torchrun every rank loads its shard of the model and rank 0 writes what
    export_hf_weights gathers."""
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    config, meta = read_checkpoint_meta(ckpt_dir)
    check_out_dir(out_dir, force)
    out_dtype = DTYPES[dtype or meta["dtype"]]
    if ranks.world_size() > 1:
        chunks, table, tp_group, pp_group, _ = checkpoint_model(ckpt_dir, tp=tp, pp=pp)
        prepare_out_dir(out_dir, force)
        load_into(chunks, ckpt_dir)
        return write_hf_checkpoint(chunks, table, out_dir, hf_config=config,
                                   side_files_from=ckpt_dir / HF_SUBDIR, tp_group=tp_group, pp_group=pp_group,
                                   dtype=out_dtype, max_shard_bytes=max_shard_bytes,
                                   bucket_bytes=bucket_bytes, progress=progress)
    if workers is not None and workers < 1:
        raise ConversionError(f"workers={workers}: give 1 or more processes")
    # The model (and its checks of the checkpoint) before --out is touched: a refused checkpoint
    # leaves a --force'd directory as it was.
    chunks, table, _, _, _ = checkpoint_model(ckpt_dir, tp=tp, pp=pp)
    layout = _hf_layout(table, out_dtype)
    workers = default_workers(len(plan_shards(layout, max_shard_bytes))) if workers is None else workers
    prepare_out_dir(out_dir, force)
    others = _spawn_parts(ckpt_dir, out_dir, dtype=out_dtype, max_shard_bytes=max_shard_bytes,
                          bucket_bytes=bucket_bytes, workers=workers) if workers > 1 else []
    try:
        files = stream_checkpoint_to_hf(chunks[0], table, ckpt_dir, out_dir, hf_config=config,
                                        side_files_from=ckpt_dir / HF_SUBDIR, dtype=out_dtype,
                                        max_shard_bytes=max_shard_bytes, bucket_bytes=bucket_bytes,
                                        progress=progress, part=0, parts=workers)
    except BaseException:
        for process in others:  # the output is incomplete anyway: no part outlives the conversion
            process.kill()
            process.join()
        raise
    if others:
        files = _join_parts(others, layout, out_dir, max_shard_bytes)
        _finish_hf_dir(out_dir, config, ckpt_dir / HF_SUBDIR, out_dtype)
    return files
