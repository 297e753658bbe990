"""What a checkpoint written by the HF <-> Megatron converter is, shared by both directions
(hf_to_mcore.py, mcore_to_hf.py; hf_conversion.py is their front door): its layout, the model it
describes at a TP / PP / VPP, loading it, and the output-directory rule (run_export.py's too).

Kept apart so that each direction depends on this module alone, never on the other direction.

Checkpoint layout written by ``hf_to_megatron`` (read by ``megatron_to_hf``, logit_check.py, the
trainer):
    <ckpt>/                 megatron.core.dist_checkpointing files (metadata.json, .metadata, *.distcp)
    <ckpt>/hf/              the source's config.json, generation_config.json and tokenizer files
    <ckpt>/convert.json     dtype, vocabulary padding and architecture the checkpoint was written with

The dist checkpoint holds ``{"model": GPTModel.sharded_state_dict()}``: global tensors keyed by
Megatron name, so it loads at any TP / PP / DP (dist checkpoints reshard on load) as long as the
loading model pads the vocabulary to the same size (``padded_vocab_size`` in convert.json).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import ranks
from megatron_dapo.convert.mapping import ConversionError
from megatron_dapo.convert.safetensors_io import read_hf_config
from megatron_dapo.convert.table import conversion_table
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

HF_SUBDIR = "hf"
META_NAME = "convert.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def build_parallel_model(hf_config: dict[str, Any], *, dtype: str, tp: int = 1, pp: int = 1,
                         vpp: int | None = None, ep: int = 1, make_vocab_size_divisible_by: int | None = None,
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
                              virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)
    table.check_parallel(tp, pp * (vpp or 1), ep)
    if not ps.model_parallel_is_initialized():
        initialize_parallel(hf_config, parallel=parallel, model=model_cfg, seed=0)
    chunks = build_model(hf_config, model=model_cfg, parallel=parallel, **overrides)
    padded = padded_vocab_size(hf_config["vocab_size"], model_cfg.make_vocab_size_divisible_by, tp)
    table = conversion_table(hf_config, padded_vocab_size=padded)
    return chunks, table, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()


def check_out_dir(out_dir: Path, force: bool) -> bool:
    """True when ``out_dir`` has content that ``force`` allows to replace."""
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ConversionError(f"{out_dir} is not empty; pass --force (force=True) to overwrite it")
        return True
    return False


def prepare_out_dir(out_dir: Path, force: bool) -> None:
    replace = check_out_dir(out_dir, force)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has looked before rank 0 deletes
    if ranks.rank() == 0:
        if replace:
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()

def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF config, convert.json) stored next to a converted checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_NAME
    if not meta_path.is_file():
        hint = ("; it is a training checkpoint: export it with `megatron-dapo export <the run's "
                "directory> --out DIR --step N`" if (ckpt_dir / "checkpoint.json").is_file() else "")
        raise ConversionError(f"{meta_path} not found: {ckpt_dir} was not written by hf_to_megatron{hint}")
    return read_hf_config(ckpt_dir / HF_SUBDIR), json.loads(meta_path.read_text())


def sharded_state_dict(chunks) -> dict:
    """megatron-training's layout: "model", or "model0", "model1", ... per virtual stage. The tensor
    keys inside are global, so the layout does not tie a checkpoint to a VPP size."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def checkpoint_model(ckpt_dir: Path, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, **overrides):
    """The model a converted checkpoint describes, at this TP / PP / VPP / EP, its weights not loaded
    (uninitialised, untouched: address space only). Returns (chunks, table, tp_group, pp_group, meta)."""
    config, meta = read_checkpoint_meta(ckpt_dir)
    divisible_by = meta["make_vocab_size_divisible_by"]
    chunks, table, tp_group, pp_group = build_parallel_model(
        config, dtype=meta["dtype"], tp=tp, pp=pp, vpp=vpp, ep=ep, make_vocab_size_divisible_by=divisible_by,
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
                             vpp: int | None = None, ep: int = 1, **overrides):
    """Build the model a converted checkpoint describes (at this TP / PP / VPP / EP) and load it.

    Returns (chunks, table, tp_group, pp_group, meta)."""
    apply_cpu_compat()  # an entry point of the converter: before megatron.core is imported
    chunks, table, tp_group, pp_group, meta = checkpoint_model(Path(ckpt_dir), tp=tp, pp=pp, vpp=vpp, ep=ep,
                                                                **overrides)
    load_into(chunks, ckpt_dir)
    return chunks, table, tp_group, pp_group, meta


def load_into(chunks, ckpt_dir) -> None:
    from megatron.core import dist_checkpointing

    sharded = sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    for key, chunk in zip(sharded, chunks):
        chunk.load_state_dict(loaded[key])
