"""HF model dir -> Megatron dist checkpoint (``hf_to_megatron``), one parameter at a time.

Kept apart from the other direction (mcore_to_hf.py), with which it shares only
converted_checkpoint.py: it works through megatron's saver, whose torch_dist save strategy is given
each item's data from the HF files as the writer reaches it (``_HFValues``, ``_streaming_save_strategy``).

Memory: ``hf_to_megatron`` builds this rank's model for the checkpoint's layout only (megatron's
``sharded_state_dict``: keys, offsets, replicas) and never touches its weights (address space, not
memory); megatron's saver gets each parameter's value from the HF files as it writes it
(``_streaming_save_strategy``), so memory holds one parameter. The files are byte for byte those
megatron's own saver writes from a loaded model (.metadata differs only in its random save id).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import ranks
from megatron_dapo.convert.export import check_hf_checkpoint, hf_shard_rows, hf_targets
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.safetensors_io import SafetensorsReader, copy_side_files, read_hf_config
from megatron_dapo.convert.table import ConversionTable, conversion_table
from megatron_dapo.mcore.converted_checkpoint import (
    HF_SUBDIR,
    META_NAME,
    DTYPE_NAMES,
    check_out_dir,
    prepare_out_dir,
    sharded_state_dict,
    build_parallel_model,
)
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                   tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int | None = None,
                   force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Convert an HF Qwen2 / Qwen3 dense dir into a Megatron dist checkpoint; returns convert.json's contents.

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
    check_out_dir(out_dir, force)
    with SafetensorsReader(hf_dir) as reader:
        if dtype is None:
            stored = reader.dtype()
            if stored not in DTYPE_NAMES:
                raise ConversionError(f"{hf_dir} stores {stored}; pass dtype='bf16' or 'fp32'")
            dtype = DTYPE_NAMES[stored]
        # The model is only the checkpoint's layout: its weights are never written (nor read), so
        # they take address space but no memory; the saver gets each value from the HF files.
        chunks, table, tp_group, pp_group = build_parallel_model(
            config, dtype=dtype, tp=tp, pp=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            perform_initialization=False)
        check_hf_checkpoint(table, reader)
        prepare_out_dir(out_dir, force)
        targets = hf_targets(chunks, table)
        with tqdm(total=len(targets), desc="HF -> Megatron", unit="tensor",
                  disable=not progress or ranks.rank() != 0) as bar:
            values = _HFValues(table, targets, reader, tp_group=tp_group, progress=bar.update)
            in_process_write_results()  # no writer Manager process to outlive a killed conversion
            try:
                dist_checkpointing.save(sharded_state_dict(chunks), str(out_dir),
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
        self._last: tuple[str, list[torch.Tensor], list[int]] | None = None  # name, row blocks, their starts
        self.error: Exception | None = None

    def _value(self, name: str, task, param) -> tuple[list[torch.Tensor], list[int]]:
        """The parameter's value as contiguous row blocks, and the flat element offset of each."""
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous value before reading the next
            rows = [r.contiguous() for r in hf_shard_rows(self.table, name, task, param, self.reader,
                                                          tp_size=self.tp_size, tp_rank=self.tp_rank)]
            starts, at = [], 0
            for r in rows:
                starts.append(at)
                at += r.numel()
            self._last = (name, rows, starts)
            self.progress()
        return self._last[1], self._last[2]

    @torch.no_grad()
    def view_of(self, saved: torch.Tensor) -> torch.Tensor:
        try:
            found = self._by_storage.get(saved.untyped_storage().data_ptr())
            if found is None:  # a copy of a parameter would be uninitialised memory here
                raise ConversionError(f"megatron's saver asked for a tensor {tuple(saved.shape)} that is no "
                                      "view of a parameter")
            name, task, param = found
            rows, starts = self._value(name, task, param)
            first = saved.storage_offset() - param.storage_offset()
            view = None
            if saved.is_contiguous():  # within one row block (fc1's gate or up half): a view of it
                for row, start in zip(rows, starts):
                    if start <= first and first + saved.numel() <= start + row.numel():
                        view = row.reshape(-1)[first - start:first - start + saved.numel()].view(saved.shape)
                        break
            if view is None:
                value = rows[0] if len(rows) == 1 else torch.cat(rows)
                # value may itself start inside a larger storage (a TP shard of a full tensor just read)
                view = value.as_strided(saved.shape, saved.stride(), value.storage_offset() + first)
            # torch.save writes a view's whole storage: keep just these bytes (as megatron's writer does)
            return view if view.untyped_storage().nbytes() == view.nbytes else view.clone()
        except Exception as e:
            self.error = e
            raise


class _BackgroundFlush:
    """Starts the written file's writeback while the writer goes on: every ``step`` bytes handed to
    the writer, a thread fdatasyncs what is written so far (another descriptor of the same file), so
    that the writer's own closing fsync finds little left to flush. The bytes are unchanged."""

    def __init__(self, path: str, step: int = 256 * 2**20):
        self.path, self.step, self._pending, self._fd = path, step, 0, None
        self._wake, self._stop = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="hf_to_megatron-flush", daemon=True)

    def _run(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._fd is not None:
                with contextlib.suppress(OSError):  # an early start only: the writer's own fsync reports
                    os.fdatasync(self._fd)
            if self._stop:
                return

    def wrote(self, nbytes: int) -> None:
        if self._fd is None:  # the writer has created the file by the time it asks for its first item
            self._fd = os.open(self.path, os.O_RDONLY)
            self._thread.start()
        self._pending += nbytes
        if self._pending >= self.step:
            self._pending = 0
            self._wake.set()

    def close(self) -> None:
        if self._fd is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            os.close(self._fd)


def _streaming_save_strategy(values: _HFValues):
    """megatron's torch_dist save strategy, with tensor data taken from ``values`` as each item is
    written instead of read from the model up front.

    Planning (keys, offsets, replicas, the .metadata file) and metadata.json are megatron's own
    code (strategies/torch.py ``TorchDistSaveShardedStrategy.async_save`` with the "mcore" writer,
    run synchronously as ``save`` does). ``prepare_write_data`` differs: megatron's resolves every
    item first (and clones views such as fc1's halves), so it holds the whole model. So does the
    write: the same torch.save records in ``__<rank>_0.distcp`` and fsync, but each item serialized
    in a thread while the previous one is written (dcp_overlapped_write), as torch's writer does not.
    """
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fs_async
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.planner import WriteItemType

    from megatron_dapo.mcore.dcp_overlapped_write import largest_tensor_bytes, write_items

    class Planner(mcore_torch.MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return data if write_item.type == WriteItemType.BYTE_IO else values.view_of(data)

    class Writer(fs_async.FileSystemWriterAsync):
        flush: _BackgroundFlush | None = None

        def prepare_write_data(self, plan, planner):
            # thread_count=1: one file per rank, byte items first, tensors in plan order (as megatron);
            # each item is resolved (read from the HF files) only when the serializer reaches it
            items = plan.items
            if not items:
                self.write_buckets, self.results_queue = [], None
                return
            name = f"{plan.storage_data.prefix}0{dcp_fs.DEFAULT_SUFFIX}"
            path = os.path.join(self.checkpoint_dir, name)
            self.flush, self._planner = _BackgroundFlush(path), planner
            self.write_buckets = [(path, name, [i for i in items if i.type == WriteItemType.BYTE_IO]
                                   + [i for i in items if i.type != WriteItemType.BYTE_IO])]
            self.results_queue = fs_async.get_write_results_queue()

        def get_save_function_and_args(self):
            return (self._write_bucket, None, []) if self.write_buckets else (None, None, [])

        def _write_bucket(self):
            """megatron's ``write_preloaded_data`` for the one bucket (results or the error to the
            results queue, fsync at the end), with dcp_overlapped_write's writer for torch's."""
            path, name, items = self.write_buckets[0]
            try:
                with open(path, "wb") as stream:
                    results = write_items(stream, items, self._planner.resolve_data, name, self.transforms,
                                          max_in_flight=largest_tensor_bytes(items), wrote=self.flush.wrote)
                    os.fsync(stream.fileno())
                self.results_queue.put({0: results})
            except Exception as e:  # noqa: BLE001 - reported by megatron's finalize, on every rank
                self.results_queue.put(e)

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
                try:
                    write(*args)
                finally:
                    if writer.flush is not None:
                        writer.flush.close()
            torch.distributed.barrier()
            state_dict_saver.save_state_dict_async_finalize(*planned)

    return Strategy()


def _divisible_by(value: int | None) -> int:
    from megatron_dapo.config import ModelConfig
    return ModelConfig().make_vocab_size_divisible_by if value is None else value
