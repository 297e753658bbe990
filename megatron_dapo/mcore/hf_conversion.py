"""HF model dir <-> Megatron dist checkpoint (torch_dist), streaming one tensor / bucket at a time.

Lives under mcore/ (the only importer of megatron.core); the pure mapping it applies is
megatron_dapo.convert. Checkpoint layout written by ``hf_to_megatron`` (read by ``megatron_to_hf``,
logit_check.py, the trainer):
    <ckpt>/                 megatron.core.dist_checkpointing files (metadata.json, .metadata, *.distcp)
    <ckpt>/hf/              the source's config.json, generation_config.json and tokenizer files
    <ckpt>/convert.json     dtype, vocabulary padding and architecture the checkpoint was written with

The dist checkpoint holds ``{"model": GPTModel.sharded_state_dict()}``: global tensors keyed by
Megatron name, so it loads at any TP / PP / DP (dist checkpoints reshard on load) as long as the
loading model pads the vocabulary to the same size (``padded_vocab_size`` in convert.json).

Memory: neither direction holds a loaded model. ``hf_to_megatron`` builds this rank's model for
the checkpoint's layout only (megatron's ``sharded_state_dict``: keys, offsets, replicas) and never
touches its weights (address space, not memory); megatron's saver gets each parameter's value from
the HF files as it writes it (``_streaming_save_strategy``), so memory holds one parameter. The
files are byte for byte those megatron's own saver writes from a loaded model (.metadata differs
only in its random save id). ``megatron_to_hf`` in one process asks megatron's loader for
``bucket_bytes`` of parameters at a time and writes each HF tensor straight into its output file
(``StreamingSafetensorsWriter``); under torchrun each rank loads its shard of the model and rank 0
writes what ``export_hf_weights`` gathers (one bucket, one output shard).
Both run in one process (TP=PP=1) or under torchrun with ``tp`` x ``pp`` dividing the world.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import ranks
from megatron_dapo.convert.export import (
    DEFAULT_BUCKET_BYTES,
    check_hf_checkpoint,
    export_hf_weights,
    hf_shard,
    hf_targets,
)
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.packing import pack_consecutive
from megatron_dapo.convert.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsReader,
    ShardedSafetensorsWriter,
    StreamingSafetensorsWriter,
    copy_side_files,
    read_hf_config,
)
from megatron_dapo.convert.table import ConversionTable, conversion_table
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

HF_SUBDIR = "hf"
META_NAME = "convert.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# megatron_to_hf: parameters read from the checkpoint (or gathered over TP / PP) per step. Memory
# holds one bucket plus megatron's loader's copy of one tensor; a larger tensor is a bucket alone.
CONVERT_BUCKET_BYTES = 256 * 2**20


def build_parallel_model(hf_config: dict[str, Any], *, dtype: str, tp: int = 1, pp: int = 1,
                         vpp: int | None = None, make_vocab_size_divisible_by: int | None = None,
                         **overrides):
    """Start torch.distributed / Megatron's parallel state if needed and build this rank's chunks
    (one per virtual pipeline stage).

    Returns (chunks, table resolved with the model's vocabulary padding, tp_group, pp_group).
    """
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    from megatron.core import parallel_state as ps

    from megatron_dapo.config import ModelConfig, ParallelConfig
    from megatron_dapo.mcore.model import build_model, padded_vocab_size
    from megatron_dapo.mcore.parallel import initialize_parallel

    table = conversion_table(hf_config)  # unsupported architecture: fail before any heavy work
    padding = {} if make_vocab_size_divisible_by is None else {
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    model_cfg = ModelConfig(dtype=dtype, **padding)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp)
    table.check_parallel(tp, pp * (vpp or 1))
    if not ps.model_parallel_is_initialized():
        initialize_parallel(hf_config, parallel=parallel, model=model_cfg, seed=0)
    chunks = build_model(hf_config, model=model_cfg, parallel=parallel, **overrides)
    padded = padded_vocab_size(hf_config["vocab_size"], model_cfg.make_vocab_size_divisible_by, tp)
    table = conversion_table(hf_config, padded_vocab_size=padded)
    return chunks, table, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()


def _check_out(out_dir: Path, force: bool) -> bool:
    """True when ``out_dir`` has content that ``force`` allows to replace."""
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ConversionError(f"{out_dir} is not empty; pass --force (force=True) to overwrite it")
        return True
    return False


def _prepare_out(out_dir: Path, force: bool) -> None:
    replace = _check_out(out_dir, force)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has looked before rank 0 deletes
    if ranks.rank() == 0:
        if replace:
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                   tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int | None = None,
                   force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Convert an HF Qwen2-family dir into a Megatron dist checkpoint; returns convert.json's contents.

    ``dtype``: "bf16" or "fp32"; None keeps the checkpoint's own dtype. TP / PP only decide how the
    work is split across the launched processes; the checkpoint itself is layout-free.
    """
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from megatron_dapo.mcore.checkpoint import in_process_write_results

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = read_hf_config(hf_dir)
    conversion_table(config)  # architecture / config errors before touching --out or megatron
    _check_out(out_dir, force)
    with SafetensorsReader(hf_dir) as reader:
        if dtype is None:
            stored = reader.dtype()
            if stored not in _DTYPE_NAMES:
                raise ConversionError(f"{hf_dir} stores {stored}; pass dtype='bf16' or 'fp32'")
            dtype = _DTYPE_NAMES[stored]
        # The model is only the checkpoint's layout: its weights are never written (nor read), so
        # they take address space but no memory; the saver gets each value from the HF files.
        chunks, table, tp_group, pp_group = build_parallel_model(
            config, dtype=dtype, tp=tp, pp=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            perform_initialization=False)
        check_hf_checkpoint(table, reader)
        _prepare_out(out_dir, force)
        targets = hf_targets(chunks, table)
        with tqdm(total=len(targets), desc="HF -> Megatron", unit="tensor",
                  disable=not progress or ranks.rank() != 0) as bar:
            values = _HFValues(table, targets, reader, tp_group=tp_group, progress=bar.update)
            in_process_write_results()  # no writer Manager process to outlive a killed conversion
            try:
                dist_checkpointing.save(_sharded_state_dict(chunks), str(out_dir),
                                        sharded_strategy=_streaming_save_strategy(values))
            except BaseException:  # torch's CheckpointException is a BaseException
                if values.error is not None:  # ours, raised inside megatron's writer: say it plainly
                    raise values.error from None
                raise
    meta = {"format_version": 1, "architecture": table.architecture, "dtype": dtype,
            "vocab_size": table.dims.vocab_size, "padded_vocab_size": table.dims.padded_vocab_size,
            "make_vocab_size_divisible_by": _divisible_by(make_vocab_size_divisible_by),
            "source": str(hf_dir)}
    if ranks.rank() == 0:
        copy_side_files(hf_dir, out_dir / HF_SUBDIR)
        (out_dir / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return meta


class _HFValues:
    """The values this rank's parameters take from an HF checkpoint, computed when megatron's
    writer asks for them, one parameter at a time.

    ``view_of(t)`` answers for a tensor the saver holds (a view of a parameter: the parameter
    itself, one half of a fused fc1, the parameter with the layer axis prepended) with the same
    view of the parameter's HF value, so the written bytes are those the saver would have read
    from a loaded model. The last value is kept for the next view of the same parameter.
    """

    def __init__(self, table: ConversionTable, targets: dict, reader: SafetensorsReader, *, tp_group,
                 progress):
        self.table, self.reader, self.progress = table, reader, progress
        self.tp_size = torch.distributed.get_world_size(tp_group)
        self.tp_rank = torch.distributed.get_rank(tp_group)
        self._by_storage = {}
        for name, (task, param) in targets.items():
            if not param.is_contiguous():  # view_of assumes the value's strides are the parameter's
                raise ConversionError(f"{name}: a non-contiguous parameter")
            key = param.untyped_storage().data_ptr()
            if key in self._by_storage:
                raise ConversionError(f"{name} shares its storage with {self._by_storage[key][0]}")
            self._by_storage[key] = (name, task, param)
        self._last: tuple[str, torch.Tensor] | None = None
        self.error: Exception | None = None

    def _value(self, name: str, task, param) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous value before reading the next
            shard = hf_shard(self.table, name, task, param, self.reader, tp_size=self.tp_size,
                             tp_rank=self.tp_rank).contiguous()
            self._last = (name, shard)
            self.progress()
        return self._last[1]

    @torch.no_grad()
    def view_of(self, saved: torch.Tensor) -> torch.Tensor:
        try:
            found = self._by_storage.get(saved.untyped_storage().data_ptr())
            if found is None:  # a copy of a parameter would be uninitialised memory here
                raise ConversionError(f"megatron's saver asked for a tensor {tuple(saved.shape)} that is no "
                                      "view of a parameter")
            name, task, param = found
            value = self._value(name, task, param)
            # value may itself start inside a larger storage (a TP shard of a full tensor just read)
            offset = value.storage_offset() + saved.storage_offset() - param.storage_offset()
            view = value.as_strided(saved.shape, saved.stride(), offset)
            # torch.save writes a view's whole storage: keep just these bytes (as megatron's writer does)
            return view if view.untyped_storage().nbytes() == view.nbytes else view.clone()
        except Exception as e:
            self.error = e
            raise


def _streaming_save_strategy(values: _HFValues):
    """megatron's torch_dist save strategy, with tensor data taken from ``values`` as each item is
    written instead of read from the model up front.

    Planning (keys, offsets, replicas, the .metadata file), the write of each item (torch.save
    records in ``__<rank>_0.distcp``, fsync) and metadata.json are megatron's own code
    (strategies/torch.py ``TorchDistSaveShardedStrategy.async_save`` with the "mcore" writer,
    run synchronously as ``save`` does); only ``prepare_write_data`` differs. Megatron's resolves
    every item first (and clones views such as fc1's halves), so it holds the whole model.
    """
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fs_async
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(mcore_torch.MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return data if write_item.type == WriteItemType.BYTE_IO else values.view_of(data)

    class LazyItems:
        """(write item, tensor) pairs, each tensor resolved when the writer reaches it."""

        def __init__(self, items, planner):
            self.items, self.planner = items, planner

        def __iter__(self):
            for item in self.items:
                yield item, self.planner.resolve_data(item)

    class Writer(fs_async.FileSystemWriterAsync):
        def prepare_write_data(self, plan, planner):
            # thread_count=1: one file per rank, byte items first, tensors in plan order (as megatron)
            items = plan.items
            if not items:
                self.write_buckets, self.results_queue = [], None
                return
            name = f"{plan.storage_data.prefix}0{dcp_fs.DEFAULT_SUFFIX}"
            data = ([(i, planner.resolve_data(i)) for i in items if i.type == WriteItemType.BYTE_IO],
                    LazyItems([i for i in items if i.type != WriteItemType.BYTE_IO], planner))
            self.write_buckets = [(os.path.join(self.checkpoint_dir, name), name, data)]
            self.results_queue = fs_async.get_write_results_queue()

    class Strategy(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sharded, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            writer = Writer(checkpoint_dir, thread_count=self.thread_count)
            planner = Planner(dedup_replicated_tensors=not self.keep_only_main_replica,
                              flatten_state_dict=False, flatten_sharded_tensors=False)
            planned = state_dict_saver.save_state_dict_async_plan(
                mcore_torch.mcore_to_pyt_state_dict(sharded, False), writer, None, 0, planner=planner)[0]
            write, _, args = writer.get_save_function_and_args()
            if write is not None:
                write(*args)
            torch.distributed.barrier()
            state_dict_saver.save_state_dict_async_finalize(*planned)

    return Strategy()


def _divisible_by(value: int | None) -> int:
    from megatron_dapo.config import ModelConfig
    return ModelConfig().make_vocab_size_divisible_by if value is None else value


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF config, convert.json) stored next to a converted checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_NAME
    if not meta_path.is_file():
        hint = ("; it is a training checkpoint: export it with `megatron-dapo export --config <the run's config> "
                "--out DIR --step N`" if (ckpt_dir / "checkpoint.json").is_file() else "")
        raise ConversionError(f"{meta_path} not found: {ckpt_dir} was not written by hf_to_megatron{hint}")
    return read_hf_config(ckpt_dir / HF_SUBDIR), json.loads(meta_path.read_text())


def _sharded_state_dict(chunks) -> dict:
    """megatron-training's layout: "model", or "model0", "model1", ... per virtual stage. The tensor
    keys inside are global, so the layout does not tie a checkpoint to a VPP size."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _checkpoint_model(ckpt_dir: Path, *, tp: int, pp: int, vpp: int | None = None, **overrides):
    """The model a converted checkpoint describes, at this TP / PP / VPP, its weights not loaded
    (uninitialised, untouched: address space only). Returns (chunks, table, tp_group, pp_group, meta)."""
    config, meta = read_checkpoint_meta(ckpt_dir)
    divisible_by = meta["make_vocab_size_divisible_by"]
    chunks, table, tp_group, pp_group = build_parallel_model(
        config, dtype=meta["dtype"], tp=tp, pp=pp, vpp=vpp, make_vocab_size_divisible_by=divisible_by,
        perform_initialization=False, **overrides)
    # Megatron pads to a multiple of divisible_by x TP, so the padded size can change with TP; the
    # dist-checkpoint loader would only report a shape mismatch deep inside.
    if table.dims.padded_vocab_size != meta["padded_vocab_size"]:
        raise ConversionError(
            f"{ckpt_dir} holds a vocabulary padded to {meta['padded_vocab_size']} rows, but at TP={tp} the "
            f"model pads {meta['vocab_size']} to {table.dims.padded_vocab_size} (a multiple of "
            f"make_vocab_size_divisible_by x TP = {divisible_by} x {tp}); convert with a "
            f"make_vocab_size_divisible_by that gives the same padding at every TP you will use")
    return chunks, table, tp_group, pp_group, meta


def load_megatron_checkpoint(ckpt_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                             vpp: int | None = None, **overrides):
    """Build the model a converted checkpoint describes (at this TP / PP / VPP) and load it.

    Returns (chunks, table, tp_group, pp_group, meta)."""
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    chunks, table, tp_group, pp_group, meta = _checkpoint_model(Path(ckpt_dir), tp=tp, pp=pp, vpp=vpp,
                                                                **overrides)
    _load_into(chunks, ckpt_dir)
    return chunks, table, tp_group, pp_group, meta


def _load_into(chunks, ckpt_dir) -> None:
    from megatron.core import dist_checkpointing

    sharded = _sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    for key, chunk in zip(sharded, chunks):
        chunk.load_state_dict(loaded[key])


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
                        tp_group=None, pp_group=None, dtype: torch.dtype | None = None,
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
    stream = export_hf_weights(chunks, table, tp_group=tp_group, pp_group=pp_group,
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


def _stream_checkpoint_to_hf(model, table: ConversionTable, ckpt_dir: Path, out_dir: Path, *,
                             hf_config: dict[str, Any], dtype: torch.dtype, max_shard_bytes: int,
                             bucket_bytes: int, progress: bool) -> list[Path]:
    """One process: read the checkpoint a bucket of parameters at a time (megatron's loader, asked
    for just those parameters' regions, into one reused arena) and write each HF tensor straight
    to its file. Memory: one bucket, not the model (``model``'s weights stay untouched)."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    sharded = model.sharded_state_dict()
    targets = hf_targets([model], table)
    buckets = pack_consecutive(list(targets), lambda name: targets[name][1].nbytes, bucket_bytes)
    # One arena for every bucket: fresh buffers per bucket would page-fault all of their memory again
    arena_bytes = max(sum(_aligned(targets[name][1].nbytes) for name in bucket) for bucket in buckets)
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=next(iter(targets.values()))[1].device)
    writer = StreamingSafetensorsWriter(out_dir, _hf_layout(table, dtype), max_shard_bytes=max_shard_bytes)
    with tqdm(total=len(table.hf_names()), desc="Megatron -> HF", unit="tensor", disable=not progress) as bar:
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
                    writer.add(hf_name, tensor.to(dtype))
                    bar.update()
    files = writer.close()
    _finish_hf_dir(out_dir, hf_config, ckpt_dir / HF_SUBDIR, dtype)
    return files


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                   tp: int = 1, pp: int = 1, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   bucket_bytes: int = CONVERT_BUCKET_BYTES, force: bool = False,
                   progress: bool = True) -> list[Path]:
    """Convert a checkpoint written by ``hf_to_megatron`` to an HF dir; ``dtype`` defaults to the
    checkpoint's (local-spec norms are fp32 even in a bf16 model, and are cast back).

    One process streams the checkpoint a bucket at a time; under torchrun every rank loads its
    shard of the model and rank 0 writes what export_hf_weights gathers."""
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    config, _ = read_checkpoint_meta(ckpt_dir)
    _check_out(out_dir, force)
    chunks, table, tp_group, pp_group, meta = _checkpoint_model(ckpt_dir, tp=tp, pp=pp)
    _prepare_out(out_dir, force)
    out_dtype = DTYPES[dtype or meta["dtype"]]
    if torch.distributed.get_world_size() == 1:
        return _stream_checkpoint_to_hf(chunks[0], table, ckpt_dir, out_dir, hf_config=config,
                                        dtype=out_dtype, max_shard_bytes=max_shard_bytes,
                                        bucket_bytes=bucket_bytes, progress=progress)
    _load_into(chunks, ckpt_dir)
    return write_hf_checkpoint(chunks, table, out_dir, hf_config=config,
                               side_files_from=ckpt_dir / HF_SUBDIR, tp_group=tp_group, pp_group=pp_group,
                               dtype=out_dtype, max_shard_bytes=max_shard_bytes,
                               bucket_bytes=bucket_bytes, progress=progress)
