"""Streaming HF safetensors I/O: read one tensor at a time, write size-bounded shards with an index.

Memory: the reader keeps at most ``max_open_files`` files memory-mapped (safe_open) and copies out
one tensor per ``get``; the writer buffers at most one shard (``max_shard_bytes``) of tensors before
writing it. Neither ever holds the whole model. File names and the index follow transformers'
``save_pretrained`` (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``; a
single shard is ``model.safetensors`` with no index), so ``from_pretrained`` loads the output.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_dapo.convert.mapping import ConversionError

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
        n = len(self._shards)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(self.out_dir / f"shard-{i:05d}.tmp", self.out_dir / final)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return [self.out_dir / f for f in names]


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
