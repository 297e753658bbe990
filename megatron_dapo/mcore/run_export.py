"""A training run's checkpoint -> an HF dir that transformers, vLLM and other evaluators load.

``megatron-dapo export RUN_DIR --out D [--step N]`` (or ``--config F`` naming the run by its
logging.dir, checkpoint.dir and model.hf_path; the toy's base under ``toy.enable``): the run's config
as run_config.py reads it. The checkpoint (the newest intact one, or step N) is loaded at the job's
TP / PP (checkpoints reshard on load, so any layout works, also under torchrun), its weights
stream out through the same conversion table the rollout sync uses, and config.json,
generation_config.json and the tokenizer come from model.hf_path. ``export.json`` records where
the weights came from. Only the model is read: no optimizer, no rollout engine, no reward pool.

One process (no torchrun) never loads the model: it streams the checkpoint's model part a bucket
of parameters at a time into the HF files, as the standalone converter does
(mcore_to_hf.stream_checkpoint_to_hf): memory of one bucket, not the model, and the same files
as loading the model and writing it (``write_hf_checkpoint``, the path of several ranks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_dapo.config import DAPOConfig
from megatron_dapo.errors import InputError
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

EXPORT_META = "export.json"


def run_checkpoint(cfg: DAPOConfig, step: int | None = None) -> Path:
    """The run's newest intact checkpoint, or the one of ``step``; InputError naming what exists."""
    from megatron_dapo.mcore.checkpoint_files import checkpoint_of_step, latest_checkpoint

    root = cfg.checkpoint_root
    if step is not None:
        return checkpoint_of_step(root, step, use="export")
    path = latest_checkpoint(root)
    if path is None:
        raise InputError(f"{root}: no intact checkpoint to export; train first (a run saves into its logging.dir's "
                         "checkpoints/, or checkpoint.dir)")
    return path


def hf_source(cfg: DAPOConfig) -> Path:
    """The HF dir the run started from (its config, generation config and tokenizer)."""
    path = Path(cfg.logging.dir) / "toy_base" if cfg.toy.enable else Path(cfg.model.hf_path or ".")
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json; export needs the HF dir the run started from "
                         "(model.hf_path, or the toy base of a toy.enable run)")
    return path


def export_run(cfg: DAPOConfig, out_dir: str | os.PathLike, *, step: int | None = None, dtype: str | None = None,
               force: bool = False, progress: bool = True, stream: bool | None = None) -> Path:
    """Writes the HF dir (rank 0; every rank of the job must call); returns the checkpoint exported.
    ``dtype``: "bf16" or "fp32"; default: the trained parameters' own. ``stream``: read the
    checkpoint a bucket at a time instead of loading the model (one process, one model chunk
    only); default: wherever it can."""
    import torch.distributed as dist

    from megatron_dapo.convert.safetensors_io import read_hf_config
    from megatron_dapo.mcore.converted_checkpoint import DTYPES, check_out_dir, prepare_out_dir
    from megatron_dapo.mcore.mcore_to_hf import write_hf_checkpoint

    out_dir = Path(out_dir)
    ckpt, src = run_checkpoint(cfg, step), hf_source(cfg)
    check_out_dir(out_dir, force)
    apply_cpu_compat()  # an entry point: before megatron.core is imported
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore.checkpoint import (
        check_loadable, load_checkpoint, model_sharded_state_dict, read_trainer_state)
    from megatron_dapo.mcore.mcore_to_hf import stream_checkpoint_to_hf
    from megatron_dapo.mcore.model import build_model, conversion_table_for
    from megatron_dapo.mcore.parallel import destroy_parallel, initialize_parallel

    hf_config = read_hf_config(src)
    own = not ps.model_parallel_is_initialized()  # then this call also tears it down
    if own:
        initialize_parallel(hf_config, parallel=cfg.parallel, model=cfg.model, seed=cfg.seed)
    # the weights stay uninitialised (address space only) where the checkpoint streams past them
    chunks = build_model(hf_config, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe, perform_initialization=False)
    table = conversion_table_for(hf_config, model=cfg.model, tp=cfg.parallel.tensor_model_parallel_size)
    p = cfg.parallel
    can_stream = dist.get_world_size() == 1 and len(chunks) == 1
    if stream and not can_stream:
        raise ValueError("stream=True: one process with one model chunk only")
    if can_stream if stream is None else stream:
        check_loadable(ckpt, model=chunks)  # what load_checkpoint checks before it reads
        state = read_trainer_state(ckpt)
        prepare_out_dir(out_dir, force)
        stream_checkpoint_to_hf(chunks[0], table, ckpt, out_dir, hf_config=hf_config, side_files_from=src,
                                dtype=DTYPES[dtype] if dtype else None,
                                sharded=model_sharded_state_dict(chunks)["model"], progress=progress)
    else:
        state = load_checkpoint(ckpt, model=chunks, load_rng=False)
        prepare_out_dir(out_dir, force)
        write_hf_checkpoint(chunks, table, out_dir, hf_config=hf_config, side_files_from=src,
                            tp_group=ps.get_tensor_model_parallel_group() if p.tensor_model_parallel_size > 1 else None,
                            pp_group=ps.get_pipeline_model_parallel_group() if p.pipeline_model_parallel_size > 1
                            else None,
                            ep_group=ps.get_expert_model_parallel_group() if p.expert_model_parallel_size > 1 else None,
                            dtype=DTYPES[dtype] if dtype else None, progress=progress)
    if dist.get_rank() == 0:
        (out_dir / "warmup.json").unlink(missing_ok=True)  # the toy base's warm-up report: not this model's
        meta = {"checkpoint": str(ckpt.resolve()), "step": state.get("step"),
                "run_dir": str(Path(cfg.logging.dir).resolve()),
                "hf_source": str(src.resolve()), "tensor_model_parallel_size": p.tensor_model_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "expert_model_parallel_size": p.expert_model_parallel_size}
        (out_dir / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    if own:
        destroy_parallel()  # gloo left alive can abort the interpreter at exit
    return ckpt

