"""HF model dir <-> Megatron dist checkpoint (torch_dist), streaming one tensor / bucket at a time.

Lives under policy/ (the only importer of megatron.core); the pure mapping it applies is
megatron_dapo.convert. Checkpoint layout written by ``hf_to_megatron`` (read by ``megatron_to_hf``,
logit_check.py, the trainer):
    <ckpt>/                 megatron.core.dist_checkpointing files (metadata.json, .metadata, *.distcp)
    <ckpt>/hf/              the source's config.json, generation_config.json and tokenizer files
    <ckpt>/convert.json     dtype, vocabulary padding and architecture the checkpoint was written with

The dist checkpoint holds ``{"model": GPTModel.sharded_state_dict()}``: global tensors keyed by
Megatron name, so it loads at any TP / PP / DP (dist checkpoints reshard on load) as long as the
loading model pads the vocabulary to the same size (``padded_vocab_size`` in convert.json).

Memory: ``hf_to_megatron`` holds this rank's model, the HF tensors of one parameter and the pages
of one memory-mapped input shard (then megatron's saver clones views such as fc1's halves);
``megatron_to_hf`` the model, a transient copy made by megatron's loader, one export bucket and
one output shard.
Both run in one process (TP=PP=1) or under torchrun with ``tp`` x ``pp`` dividing the world.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.convert.export import DEFAULT_BUCKET_BYTES, export_hf_weights, load_hf_weights
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsReader,
    ShardedSafetensorsWriter,
    copy_side_files,
    read_hf_config,
)
from megatron_dapo.convert.table import ConversionTable, conversion_table
from megatron_dapo.policy.cpu_compat import apply_cpu_compat

HF_SUBDIR = "hf"
META_NAME = "convert.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _ensure_process_env() -> None:
    """A single process started without torchrun: give env:// a world of one."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")


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
    from megatron_dapo.policy.model import build_model, padded_vocab_size
    from megatron_dapo.policy.parallel import initialize_parallel

    table = conversion_table(hf_config)  # unsupported architecture: fail before any heavy work
    padding = {} if make_vocab_size_divisible_by is None else {
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    model_cfg = ModelConfig(dtype=dtype, **padding)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp)
    table.check_parallel(tp, pp * (vpp or 1))
    _ensure_process_env()
    if not ps.model_parallel_is_initialized():
        initialize_parallel(hf_config, parallel=parallel, model=model_cfg, seed=0)
    chunks = build_model(hf_config, model=model_cfg, parallel=parallel, **overrides)
    padded = padded_vocab_size(hf_config["vocab_size"], model_cfg.make_vocab_size_divisible_by, tp)
    table = conversion_table(hf_config, padded_vocab_size=padded)
    return chunks, table, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


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
    if _rank() == 0:
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

    from megatron_dapo.policy.checkpoint import in_process_write_results

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
        chunks, table, tp_group, pp_group = build_parallel_model(
            config, dtype=dtype, tp=tp, pp=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            perform_initialization=False)  # every weight is overwritten below
        _prepare_out(out_dir, force)
        num_params = sum(1 for c in chunks for _ in c.named_parameters())
        with tqdm(total=num_params, desc="HF -> Megatron", unit="tensor",
                  disable=not progress or _rank() != 0) as bar:
            load_hf_weights(chunks, table, reader, tp_group=tp_group, progress=bar.update)
    in_process_write_results()  # no writer Manager process to outlive a killed conversion
    dist_checkpointing.save(_sharded_state_dict(chunks), str(out_dir))
    meta = {"format_version": 1, "architecture": table.architecture, "dtype": dtype,
            "vocab_size": table.dims.vocab_size, "padded_vocab_size": table.dims.padded_vocab_size,
            "make_vocab_size_divisible_by": _divisible_by(make_vocab_size_divisible_by),
            "source": str(hf_dir)}
    if _rank() == 0:
        copy_side_files(hf_dir, out_dir / HF_SUBDIR)
        (out_dir / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return meta


def _divisible_by(value: int | None) -> int:
    from megatron_dapo.config import ModelConfig
    return ModelConfig().make_vocab_size_divisible_by if value is None else value


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF config, convert.json) stored next to a converted checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_NAME
    if not meta_path.is_file():
        hint = (f"; it is a training checkpoint: export it with `megatron-dapo export --config <the run's config> "
                f"--out DIR --step N`" if (ckpt_dir / "checkpoint.json").is_file() else "")
        raise ConversionError(f"{meta_path} not found: {ckpt_dir} was not written by hf_to_megatron{hint}")
    return read_hf_config(ckpt_dir / HF_SUBDIR), json.loads(meta_path.read_text())


def _sharded_state_dict(chunks) -> dict:
    """megatron-training's layout: "model", or "model0", "model1", ... per virtual stage. The tensor
    keys inside are global, so the layout does not tie a checkpoint to a VPP size."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def load_megatron_checkpoint(ckpt_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                             vpp: int | None = None, **overrides):
    """Build the model a converted checkpoint describes (at this TP / PP / VPP) and load it.

    Returns (chunks, table, tp_group, pp_group, meta)."""
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    from megatron.core import dist_checkpointing

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
    sharded = _sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    for key, chunk in zip(sharded, chunks):
        chunk.load_state_dict(loaded[key])
    return chunks, table, tp_group, pp_group, meta


def write_hf_checkpoint(chunks, table: ConversionTable, out_dir: str | os.PathLike, *,
                        hf_config: dict[str, Any], side_files_from: str | os.PathLike | None = None,
                        tp_group=None, pp_group=None, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, progress: bool = True) -> list[Path]:
    """Stream a live (possibly sharded) model into an HF dir; rank 0 writes, every rank must call.

    ``dtype``: of the written tensors; default: each parameter's own."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes) if _rank() == 0 else None
    written = dtype
    stream = export_hf_weights(chunks, table, tp_group=tp_group, pp_group=pp_group,
                               bucket_bytes=bucket_bytes, device="cpu", dtype=dtype)
    for name, tensor in tqdm(stream, total=len(table.hf_names()), desc="Megatron -> HF", unit="tensor",
                             disable=not progress or _rank() != 0):
        if writer is not None:
            writer.add(name, tensor)
            written = written or tensor.dtype
    if writer is not None:
        files = writer.close()
        if side_files_from is not None:
            copy_side_files(side_files_from, out_dir)
        config = {k: v for k, v in hf_config.items() if k != "torch_dtype"}
        config["dtype"] = _HF_DTYPE_NAMES.get(written, str(written).removeprefix("torch."))
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return files
    return []


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None,
                   tp: int = 1, pp: int = 1, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, force: bool = False,
                   progress: bool = True) -> list[Path]:
    """Convert a checkpoint written by ``hf_to_megatron`` to an HF dir; ``dtype`` defaults to the
    checkpoint's (local-spec norms are fp32 even in a bf16 model, and are cast back)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    config, _ = read_checkpoint_meta(ckpt_dir)
    _check_out(out_dir, force)
    chunks, table, tp_group, pp_group, meta = load_megatron_checkpoint(ckpt_dir, tp=tp, pp=pp)
    _prepare_out(out_dir, force)
    return write_hf_checkpoint(chunks, table, out_dir, hf_config=config,
                               side_files_from=ckpt_dir / HF_SUBDIR, tp_group=tp_group, pp_group=pp_group,
                               dtype=DTYPES[dtype or meta["dtype"]], max_shard_bytes=max_shard_bytes,
                               bucket_bytes=bucket_bytes, progress=progress)
