"""Reading a torch_dist checkpoint's tensors straight into the tensors that receive them.

torch DCP's ``FileSystemReader`` reads each tensor record with ``torch.load`` (a fresh tensor:
all of its memory touched for the first time) and then copies it into the destination; the
converter's Megatron -> HF stream spent a third of its time there, and held the largest tensor
twice (docs/conversion.md, "Where the time goes"). A record is a ``torch.save`` zip archive whose
entries are stored uncompressed: when it holds one whole contiguous tensor of the destination's
dtype and shape, one ``readinto`` from the file fills the destination. Any other record (a
slice, a transform, a dtype or stride it does not match, an object) goes through torch's own path,
so what is loaded never differs, only how.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict

import torch

# The storage classes a torch.save pickle names (torch/storage.py), by the dtype they hold.
_STORAGES = {"BFloat16Storage": torch.bfloat16, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
             "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ByteStorage": torch.uint8, "BoolStorage": torch.bool}
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip entry's local header (30 bytes)


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where a record's one tensor lies in its file: ``data_offset`` from the record's start."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # elements
    storage_numel: int
    data_offset: int


class _Header(pickle.Unpickler):
    """A record's data.pkl, read as the layout of one plain tensor (anything else raises)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"not a storage: {kind}")
        return dtype, str(key), int(numel)


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.at = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.at = {os.SEEK_SET: 0, os.SEEK_CUR: self.at, os.SEEK_END: self.length}[whence] + pos
        return self.at

    def readinto(self, buffer) -> int:
        n = max(min(len(buffer), self.length - self.at), 0)
        self.file.seek(self.offset + self.at)
        got = self.file.readinto(memoryview(buffer)[:n])
        self.at += got
        return got


def tensor_record(file, offset: int, length: int) -> TensorRecord | None:
    """The tensor a torch.save record at [offset, offset + length) of ``file`` holds, or None when
    it is not one plain tensor with its storage stored uncompressed."""
    try:
        with zipfile.ZipFile(_Slice(file, offset, length)) as record:
            names = record.namelist()
            pkl = next(n for n in names if n.endswith("/data.pkl"))
            storage, start, size, stride = _Header(io.BytesIO(record.read(pkl))).load()
            dtype, key, numel = storage
            entry = record.getinfo(f"{pkl[:-len('data.pkl')]}data/{key}")
    except Exception:  # not a zip, not one tensor: torch's own reader handles it
        return None
    if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != numel * dtype.itemsize:
        return None
    file.seek(offset + entry.header_offset)
    header = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        return None
    data = entry.header_offset + _LOCAL_HEADER.size + header[-2] + header[-1]  # + name + extra field
    return TensorRecord(dtype, size, stride, int(start), numel, data)


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class InPlaceReader(FileSystemReader):
        """torch DCP's reader; a request for a whole contiguous tensor record is read in place.
        ``metadata_cache``: the checkpoint's .metadata, unpickled once for every load that shares it."""

        metadata_cache: dict | None = None

        def read_metadata(self, *args, **kwargs):
            if self.metadata_cache is None:
                return super().read_metadata(*args, **kwargs)
            key = (str(self.path), kwargs.get("rank"))
            if key not in self.metadata_cache:
                self.metadata_cache[key] = super().read_metadata(*args, **kwargs)
            metadata = self.metadata_cache[key]
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id  # as the reader's own read sets it
            return metadata

        def _read_in_place(self, file, request, planner) -> bool:
            info = self.storage_data[request.storage_index]
            if request.type != LoadItemType.TENSOR or info.transform_descriptors or any(request.storage_offsets):
                return False
            record = tensor_record(file, info.offset, info.length)
            if record is None or record.storage_offset or tuple(request.lengths) != record.size:
                return False
            target = planner.resolve_tensor(request).detach()
            numel = target.numel()
            if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != record.dtype
                    or tuple(target.shape) != record.size or record.storage_numel != numel
                    or (numel > 1 and record.stride != target.stride())):
                return False
            if numel:
                buffer = target.view(-1).view(torch.uint8).numpy()
                file.seek(info.offset + record.data_offset)
                if file.readinto(buffer) != buffer.nbytes:
                    raise OSError(f"{info.relative_path}: short read at byte {info.offset + record.data_offset}")
            planner.commit_tensor(request, target)
            return True

        def read_data(self, plan, planner):
            by_file: dict[str, list] = {}
            for request in plan.items:
                by_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
            rest = []
            for relative, requests in by_file.items():
                with open(self.fs.concat_path(self.path, relative), "rb", buffering=0) as file:
                    rest += [r for r in requests if not self._read_in_place(file, r, planner)]
            if rest:
                return super().read_data(dataclasses.replace(plan, items=rest), planner)
            done: Future = Future()
            done.set_result(None)
            return done

    return InPlaceReader


@contextlib.contextmanager
def records_read_in_place():
    """Within it, megatron's torch_dist loader (``dist_checkpointing.load``) reads through
    ``InPlaceReader``, and the loads share the checkpoint's metadata (a converter loads one
    checkpoint a bucket at a time: unpickled once, not twice a bucket). megatron-core 0.19.2 builds
    its reader in one module function (strategies/torch.py ``_get_filesystem_reader``) and takes no
    reader from its caller; the converter is one thread, and the function is restored on the way out."""
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    built, reader, metadata = strategy._get_filesystem_reader, _reader_class(), {}

    def in_place(checkpoint_dir, cache_metadata: bool = False, **kwargs):
        if cache_metadata or strategy.MultiStorageClientFeature.is_enabled():
            return built(checkpoint_dir, cache_metadata=cache_metadata, **kwargs)
        made = reader(checkpoint_dir)
        made.metadata_cache = metadata
        return made

    strategy._get_filesystem_reader = in_place
    try:
        yield
    finally:
        strategy._get_filesystem_reader = built
