"""Writing a torch_dist checkpoint's items with each item's serialization overlapping the previous
item's file writes.

torch DCP's ``_write_item`` (torch/distributed/checkpoint/filesystem.py) runs ``torch.save`` of an
item straight into the file: the zip records' crc32 and the write syscalls take turns on one
thread, and were most of the HF -> Megatron converter's time (benchmarks/convert.py --profile).
``write_items`` runs the same ``torch.save`` (through the same stream transforms) into a capture
in a second thread, which releases the GIL while it checksums, while the calling thread writes
the previous item's captured bytes to the file. The file bytes and the ``WriteResult``s (offset from the
stream's ``tell()`` before the item, length the bytes it took, the transforms' descriptors) are
those ``_write_item`` gives. A capture holds only the item's headers: the bytes of the tensor's
storage stay in the tensor until they are written.
"""

from __future__ import annotations

import io
import math
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageWriterTransforms
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

_KEEP_FROM = 64 * 1024  # writes at least this large are checked for being the tensor's storage (kept, not copied)


class _Capture:
    """The file-like object ``torch.save`` writes one item into: the bytes it is given, in order.

    A write of the tensor's own storage memory is kept as the view torch.save passed (valid while
    the tensor lives, which the item's queue entry ensures); any other write is copied.
    """

    def __init__(self, tensor: torch.Tensor | None):
        storage = None if tensor is None else tensor.untyped_storage()
        self._storage = None if storage is None else (storage.data_ptr(), storage.nbytes())
        self.chunks: list[Any] = []
        self._copied = bytearray()

    def write(self, b) -> int:
        view = memoryview(b)
        if view.nbytes >= _KEEP_FROM and self._is_storage(view):
            self._end_copied()
            self.chunks.append(view)
        else:
            self._copied += view
        return view.nbytes

    def flush(self) -> None:
        pass

    def done(self) -> list[Any]:
        self._end_copied()
        return self.chunks

    def _end_copied(self) -> None:
        if self._copied:
            self.chunks.append(self._copied)
            self._copied = bytearray()

    def _is_storage(self, view: memoryview) -> bool:
        if self._storage is None or not view.contiguous:
            return False
        start, nbytes = self._storage
        at = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data
        return start <= at and at + view.nbytes <= start + nbytes


def serialize(transforms: _StorageWriterTransforms, item: WriteItem, data: io.BytesIO | torch.Tensor
              ) -> tuple[list[Any], list[str]]:
    """``_write_item``'s writes for ``item`` (TORCH_SAVE format), captured: the chunks to write in
    order, and the transforms' descriptors."""
    tensor = data if item.type != WriteItemType.BYTE_IO else None
    capture = _Capture(tensor)
    transform_to, descriptors = transforms.transform_save_stream(item, capture)
    if tensor is None:
        if not isinstance(data, io.BytesIO):
            raise AssertionError("Data must be io.BytesIO for BYTE_IO write items")
        transform_to.write(data.getbuffer())
    else:
        if not isinstance(data, torch.Tensor) or data.device != torch.device("cpu"):
            raise AssertionError("Data must be a CPU torch.Tensor for non-BYTE_IO write items")
        torch.save(data, transform_to)
    transform_to.close()
    return capture.done(), descriptors


class _Serializer:
    """Resolves and serializes ``items`` in order in a thread, ahead of the writer by at most
    ``max_in_flight`` bytes of tensor data (counting the item being written); an item larger than
    that is serialized only once nothing else is in flight, so memory holds at most one such item.
    """

    _DONE = object()

    def __init__(self, items: Sequence[WriteItem], resolve: Callable[[WriteItem], Any],
                 transforms: _StorageWriterTransforms, max_in_flight: int):
        self.items, self.resolve, self.transforms, self.max_in_flight = items, resolve, transforms, max_in_flight
        self._ready: queue.Queue = queue.Queue()
        self._room = threading.Condition()
        self._in_flight, self._stopped = 0, False
        self._thread = threading.Thread(target=self._run, name="dcp-serialize", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self.items:
                size = chunk_bytes(item)
                if not self._reserve(size):
                    return
                data = self.resolve(item)
                chunks, descriptors = serialize(self.transforms, item, data)
                self._ready.put((item, data, chunks, descriptors, size))
                del data, chunks  # the writer's entry alone keeps an item's memory alive
            self._ready.put(self._DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the writer, which raises it
            self._ready.put(e)

    def _reserve(self, size: int) -> bool:
        with self._room:
            self._room.wait_for(lambda: self._stopped or self._in_flight == 0
                                or self._in_flight + size <= self.max_in_flight)
            self._in_flight += size
            return not self._stopped

    def release(self, size: int) -> None:
        with self._room:
            self._in_flight -= size
            self._room.notify_all()

    def next(self) -> tuple | None:
        """The next serialized item, or None after the last; raises what the thread raised."""
        got = self._ready.get()
        if got is self._DONE:
            return None
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self) -> None:
        with self._room:
            self._stopped = True
            self._room.notify_all()
        self._thread.join()


def write_items(stream: io.BufferedIOBase, items: Sequence[WriteItem], resolve: Callable[[WriteItem], Any],
                storage_key: str, transforms: _StorageWriterTransforms, *, max_in_flight: int,
                wrote: Callable[[int], None] | None = None) -> list[WriteResult]:
    """Write ``items`` (``resolve(item)``: its data) to ``stream`` in order as ``_write_item`` does
    in TORCH_SAVE format, serializing the next item while this one is written; ``wrote(nbytes)``
    after each item reaches the stream."""
    serializer = _Serializer(items, resolve, transforms, max_in_flight)
    results = []
    try:
        while (entry := serializer.next()) is not None:
            item, _data, chunks, descriptors, size = entry
            offset = stream.tell()
            for chunk in chunks:
                stream.write(chunk)
            stream.flush()  # as _write_item's close of its stream wrapper does
            length = stream.tell() - offset
            del entry, _data, chunks  # before making room: the next item may take this one's memory
            serializer.release(size)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(
                storage_key, offset, length, transform_descriptors=descriptors or None)))
            if wrote is not None:
                wrote(length)
    finally:
        serializer.close()
    return results


def chunk_bytes(item: WriteItem) -> int:
    """The bytes of the tensor chunk ``item`` writes (0 for a byte item). Not torch's ``_item_size``:
    that is the size of the whole tensor the chunk belongs to (a layer of a stacked tensor, a TP shard)."""
    if item.type == WriteItemType.BYTE_IO:
        return 0
    data = item.tensor_data
    return math.prod(data.chunk.sizes) * torch._utils._element_size(data.properties.dtype)


def largest_tensor_bytes(items: Sequence[WriteItem]) -> int:
    """The bytes of the largest tensor chunk: a ``max_in_flight`` that holds no more memory than
    writing that item alone does."""
    return max(map(chunk_bytes, items), default=0)
