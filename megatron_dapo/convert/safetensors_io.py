"""Streaming HF safetensors I/O: read one tensor at a time, write size-bounded shards with an index.

Memory: the reader keeps at most ``max_open_files`` files memory-mapped (safe_open) and copies out
one tensor per ``get``; ``ShardedSafetensorsWriter`` buffers at most one shard (``max_shard_bytes``)
of tensors before writing it; ``StreamingSafetensorsWriter``, told every tensor's name, shape and
dtype up front, writes each header first and then each tensor's bytes as it arrives (nothing
buffered, no serialising copy). None ever holds the whole model. File names and the index follow transformers'
``save_pretrained`` (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``; a
single shard is ``model.safetensors`` with no index), so ``from_pretrained`` loads the output.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.packing import pack_consecutive

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
# Everything a model dir carries besides weights: config, generation config, tokenizer files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")


class SafetensorsReader:
    """Random access, one tensor at a time, to an HF checkpoint dir (single file or sharded)."""

    def __init__(self, path: str | os.PathLike, *, max_open_files: int = 1):
        path = Path(path)
        if (path / INDEX_NAME).is_file():
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
            self.files = {name: path / f for name, f in weight_map.items()}
        else:
            singles = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
            if len(singles) != 1:
                raise ConversionError(f"{path}: expected {INDEX_NAME} or exactly one *.safetensors file, "
                                      f"found {[p.name for p in singles]}")
            with safe_open(singles[0], framework="pt") as f:
                self.files = {name: singles[0] for name in f.keys()}
        self._open: OrderedDict[Path, object] = OrderedDict()
        self._max_open = max_open_files

    def names(self) -> list[str]:
        """Tensor names, grouped by file so that a pass in this order maps each file once."""
        return sorted(self.files, key=lambda n: (str(self.files[n]), n))

    def _handle(self, name: str):
        if name not in self.files:
            raise ConversionError(f"HF checkpoint has no tensor {name!r}")
        file = self.files[name]
        if file in self._open:
            self._open.move_to_end(file)
        else:
            if not file.is_file():
                raise ConversionError(f"{file} (listed for {name!r}) does not exist")
            self._open[file] = safe_open(file, framework="pt")
            if len(self._open) > self._max_open:  # unmap the least recently used file
                self._open.popitem(last=False)
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def dtype(self) -> torch.dtype:
        """dtype of the first tensor (checkpoints store one dtype)."""
        first = self.names()[0]
        return self.get(first).dtype

    def close(self) -> None:
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ShardedSafetensorsWriter:
    """Write (name, tensor) pairs into shards of at most ``max_shard_bytes`` (a single larger tensor
    gets a shard of its own), then ``close()`` names them and writes the index."""

    def __init__(self, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ConversionError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous()
        # A view into a larger storage (q/k/v out of a fused qkv) would make safetensors refuse or
        # store the whole storage: keep just this tensor's bytes.
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, give the shards their final names, write the index."""
        if self._pending or not self._shards:
            self._flush()
        return _name_shards(self.out_dir, self._shards, self.total_bytes)


def _name_shards(out_dir: Path, shards: list[list[str]], total_bytes: int) -> list[Path]:
    """Rename ``shard-<i>.tmp`` to transformers' names; with several shards, write the index."""
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, final in enumerate(names):
        os.replace(out_dir / f"shard-{i:05d}.tmp", out_dir / final)
    if n > 1:
        weight_map = {t: names[i] for i, shard in enumerate(shards) for t in shard}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / f for f in names]


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# save_file writes a file's tensors by dtype, the highest first in safetensors' Dtype order (F16 < BF16
# < F32), then by name (safetensors 0.8's serialize: its sort before writing)
_SAVE_FILE_RANK = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def plan_shards(layout: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[str]]:
    """The tensor names of each shard for ``layout``'s (name, shape, dtype) in order:
    ShardedSafetensorsWriter's packing; an empty layout is one empty shard, as there."""
    sizes = [(name, math.prod(shape) * dtype.itemsize) for name, shape, dtype in layout]
    return [[name for name, _ in group] for group in pack_consecutive(sizes, lambda s: s[1], max_shard_bytes)] or [[]]


class StreamingSafetensorsWriter:
    """``ShardedSafetensorsWriter``'s output (the same shards, names and index) for tensors known
    in advance: ``layout`` lists (name, shape, dtype) in the order ``add`` will receive them.
    Each shard's header is written when the shard is opened, each tensor's bytes as it is added.

    ``part`` / ``parts``: this writer writes shards ``part``, ``part + parts``, ... of the plan
    only (``wants`` says which tensors); several processes write one checkpoint side by side, and
    ``name_parts`` names the shards and writes the index once every part is closed. The files are
    those one writer writes.

    The file format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
    header length, a JSON header with every tensor's dtype, shape and byte range, space-padded
    to a multiple of 8 bytes, then the tensors' bytes back to back, in ``layout`` order; with
    ``as_save_file``, in the order safetensors' ``save_file`` puts a shard's tensors (by dtype,
    the widest first, then by name), so that the files are ``ShardedSafetensorsWriter``'s byte
    for byte: each tensor still goes to its place in the file as it arrives (no buffering).
    """

    def __init__(self, out_dir: str | os.PathLike, layout: list[tuple[str, tuple[int, ...], torch.dtype]], *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, part: int = 0, parts: int = 1,
                 as_save_file: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        unsupported = {str(dtype) for _, _, dtype in layout if dtype not in _SAFETENSORS_DTYPES}
        if unsupported:
            raise ConversionError(f"cannot write {sorted(unsupported)} tensors")
        self._layout = {name: (tuple(shape), dtype) for name, shape, dtype in layout}
        self._shards = plan_shards(layout, max_shard_bytes)
        if as_save_file:
            self._shards = [sorted(shard, key=lambda name: (-_SAVE_FILE_RANK[self._layout[name][1]], name))
                            for shard in self._shards]
        self.part, self.parts = part, parts
        self._shard_of = {name: i for i, shard in enumerate(self._shards) for name in shard}
        self._order = [name for name, _, _ in layout if self._shard_of[name] % parts == part]
        self._next = 0
        self._file = None
        self._shard_index = -1
        self.total_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)

    def wants(self, name: str) -> bool:
        """Whether ``name`` is one of this part's tensors."""
        return self._shard_of[name] % self.parts == self.part

    def _open_shard(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        self._shard_index = index
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self._shards[self._shard_index]:
            shape, dtype = self._layout[name]
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, end]}
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        data_start = 8 + len(encoded)
        self._at = {name: data_start + header[name]["data_offsets"][0] for name in self._shards[self._shard_index]}
        # open across add() calls, closed by the next shard or close()
        self._file = open(self.out_dir / f"shard-{self._shard_index:05d}.tmp", "wb")  # noqa: SIM115
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ConversionError(f"tensor {name!r} added where the layout expects {expected!r}")
        shape, dtype = self._layout[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ConversionError(f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the layout says "
                                  f"{shape} {dtype}")
        if self._shard_of[name] != self._shard_index:
            self._open_shard(self._shard_of[name])
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if self._file.tell() != self._at[name]:  # as_save_file: not the next one in the file
            self._file.seek(self._at[name])
        self._file.write(flat.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> list[Path]:
        """Check that every tensor of the layout (of this part) came; one part: give the shards their
        final names and write the index (as ``ShardedSafetensorsWriter.close``), else ``name_parts``
        does once every part is closed."""
        if self._next != len(self._order):
            raise ConversionError(f"{len(self._order) - self._next} tensors of the layout were never added, "
                                  f"the first {self._order[self._next]!r}")
        for index in range(self.part, len(self._shards), self.parts):
            if not self._shards[index]:  # an empty layout: one empty shard, as ShardedSafetensorsWriter
                self._open_shard(index)
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.name_parts() if self.parts == 1 else []

    def name_parts(self) -> list[Path]:
        """Every part's shards under transformers' names, and the index: after every part closed."""
        return _name_shards(self.out_dir, self._shards, self.total_bytes)


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy config.json, generation_config.json, tokenizer and chat-template files: every regular
    file of ``src`` that is not a weight file or an index. Returns the copied names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found: an HF model dir needs its config.json")
    return json.loads(path.read_text())
