"""Every rule a launch checks that a config alone cannot decide, in one place.

A config's own rules run when it is built: each section's beside its fields (config.py), the ones
that span sections in config_rules.py. What needs more than the config -- the launch's world size,
this machine and its installed packages, the model's config.json, the run directory, the disk --
is checked here, before anything heavy, as one line (ConfigError for a setting, InputError for a
file), through four entries that ``run.prepare_run`` calls in this order:

1. ``check_settings(cfg, engine_ranks)``, first and on every rank (a separate placement runs it in
   the CLI before its world splits, so a bad setting never leaves a side waiting): the rollout
   settings against the engine ranks and the engine's package (partial rollouts' engine and
   replicas; the engine's own ``preflight``, rollout/vllm_checks.py for vLLM), the model settings
   against this machine (dtype, FP8 and the TE spec need CUDA and TE).
   The separate placement's split of the world is ``rollout/worlds.check_split``'s, before any
   rendezvous.
2. ``check_checkpoints(ckpt_dir)``, before the run directory is locked or written: a run that saved
   checkpoints has an intact one to resume from. (The CPU demo's run directory is checked against
   the toy settings it was made with at the same moment, by toy/bootstrap.check: run.py is the one
   module that reaches the demo's code.)
3. ``check_against_model(cfg, hf_config, world_size, saves=...)``, once model.hf_path's config.json
   is read and before any data is: the parallel layout against the model (mcore/parallel.py:
   heads, layers, world size, experts, packing, context parallelism) and the disk for the
   checkpoints the run keeps.
4. ``check_checkpoint_shape`` and ``check_start_checkpoint``: the checkpoint resumed from or evaluated
   (right after entry 3, before the data is read) and the one started from (``model.checkpoint``,
   after the prompts are read) holds a model of config.json's shape.

The data's own checks (empty files, prompts over data.max_prompt_length, malformed rows) are the
loading's (run._prompts, data/), where the rows are read.
"""

import shutil
from pathlib import Path

from megatron_dapo.config import DAPOConfig
from megatron_dapo.errors import ConfigError, InputError


def check_against_model(cfg: DAPOConfig, hf_config: dict, world_size: int, *, saves: bool) -> None:
    """Entry 3 (module doc): the layout of ``world_size`` ranks against the model and, when the job
    ``saves`` checkpoints, the disk."""
    check_layout(cfg, hf_config, world_size)
    if saves:
        check_disk(cfg, hf_config)


def check_settings(cfg: DAPOConfig, engine_ranks: int) -> None:
    """The rollout and model settings this launch (``engine_ranks`` ranks hold engines) or this
    machine cannot run; a ConfigError. A separate placement runs it on every rank before its split
    starts any process group, so that a bad setting is one line on every rank, not a trainer's error
    that the engines wait out or that the transfer group's teardown hides."""
    check_rollout(cfg, engine_ranks)
    check_model(cfg)


def check_model(cfg: DAPOConfig) -> None:
    """The model settings this machine cannot run (FP8 or the TE spec without CUDA / TE), before
    anything is written; a ConfigError, which the CLI prints as one line."""
    import torch

    from megatron_dapo.mcore.model import resolve_runtime

    resolve_runtime(cfg.model, torch.cuda.is_available())


def check_layout(cfg: DAPOConfig, hf_config: dict, world_size: int) -> None:
    """The parallel layout against the model (heads, layers, world size, known-bad combinations),
    before any model is built; a ConfigError, which the CLI prints as one line."""
    import torch

    from megatron_dapo.mcore.parallel import (
        check_moe_layout, check_packing, check_training_layout, validate_parallel,
    )

    validate_parallel(hf_config, parallel=cfg.parallel, model=cfg.model, world_size=world_size,
                      on_gpu=torch.cuda.is_available())
    check_training_layout(hf_config, cfg.parallel)
    check_moe_layout(hf_config, moe=cfg.moe, parallel=cfg.parallel)
    if cfg.train.pack_sequences is True:  # auto packs only where it is supported (micro_batch_shapes.py)
        from megatron_dapo.mcore.model import resolve_runtime

        runtime = resolve_runtime(cfg.model, torch.cuda.is_available(), check_installed=False)
        check_packing(transformer_impl=runtime.transformer_impl)


def check_disk(cfg: DAPOConfig, hf_config: dict) -> None:
    """InputError when checkpoint.dir's file system cannot hold the checkpoints the run keeps (one
    more than checkpoint.keep_last while a save is published), counting those already there: a
    full disk found at the first save would cost the steps before it."""
    import torch

    from megatron_dapo.memory_plan import count_parameters
    from megatron_dapo.precision import resolve_dtype

    root = cfg.checkpoint_root
    probe = next(p for p in (root, *root.parents) if p.exists())
    hf = {**hf_config, "num_key_value_heads": hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]}
    params = count_parameters(hf, tp=1, pp=1, padded_vocab=hf["vocab_size"]).total
    # weights, fp32 main weights when they are bf16, and Adam's two fp32 moments
    per_param = 12 if resolve_dtype(cfg.model.dtype, torch.cuda.is_available()) == "fp32" else 14
    each = params * per_param
    there = sum(f.stat().st_size for f in root.glob("step_*/**/*") if f.is_file()) if root.is_dir() else 0
    free = shutil.disk_usage(probe).free
    need = (cfg.checkpoint.keep_last + 1) * each
    if free + there < need:
        raise InputError(f"checkpoint.dir={root}: {_size(free)} free on its file system ({_size(there)} in "
                         f"checkpoints there), the run needs ~{_size(need)}: checkpoint.keep_last+1="
                         f"{cfg.checkpoint.keep_last + 1} checkpoints of ~{_size(each)} ({params:,} parameters x "
                         f"{per_param} bytes); free space, point checkpoint.dir elsewhere, or lower "
                         "checkpoint.keep_last")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def check_rollout(cfg: DAPOConfig, world_size: int) -> None:
    """The rollout settings that need the world size or the installed packages, before heavy work
    (the engine's own ``preflight``); a ConfigError, which the CLI prints as one line."""
    from megatron_dapo.rollout.engine import EngineSpec, get_engine_cls  # the engine module, not vllm
    from megatron_dapo.rollout.placement import replica_layout

    r = cfg.rollout
    _, replicas, _ = replica_layout(0, world_size, r.tensor_parallel_size)
    engine = get_engine_cls(r.engine)
    if r.partial and not engine.continues_prefixes:
        raise ConfigError(f"rollout.partial=true with rollout.engine={r.engine}: this engine cannot continue a "
                          "response from its prefix; use rollout.engine=vllm or hf, or rollout.partial=false")
    if r.partial and r.placement == "colocated" and replicas > 1:
        # The carried responses live on one replica leader (gen_batches.py): one colocated replica, or
        # separate placement, whose engine replicas all answer trainer rank 0.
        raise ConfigError(f"rollout.partial=true with {replicas} colocated rollout replicas: partial rollouts need "
                          "one replica's leader to hold every response; use rollout.placement=separate with "
                          f"rollout.num_ranks, or rollout.tensor_parallel_size={world_size}")
    engine.preflight(EngineSpec.of(cfg))


def check_checkpoints(ckpt_dir: Path) -> None:
    """InputError when the run has saved checkpoints and none is intact, before anything (the lock
    file included) is written: starting over would silently drop every metrics record of the run."""
    from megatron_dapo.mcore.checkpoint import why_none_usable

    if why := why_none_usable(ckpt_dir):
        raise InputError(f"{ckpt_dir}: no intact checkpoint to resume from ({why}); nothing was changed. Restore "
                         "the checkpoints from a copy, or start the run over on purpose with "
                         "checkpoint.resume=never (metrics.jsonl is then rewritten from step 0) or a new logging.dir")


def check_start_checkpoint(path: Path, hf_config: dict) -> None:
    """model.checkpoint must hold weights of model.hf_path's shape: a typo would otherwise start
    from random weights, another model would fail deep in megatron's loader."""
    from megatron_dapo.hf_dir import read_config
    from megatron_dapo.mcore.checkpoint import latest_checkpoint, read_meta

    fix = "point model.checkpoint at a conversion of model.hf_path (tools/convert_ckpt/hf_to_megatron.py)"
    if (path / "metadata.json").is_file():
        meta = read_meta(path)  # a run's step_* dir
        if meta is None and (path / "hf" / "config.json").is_file():  # converted: the config it was made from
            meta = {"model_shape": model_shape_of(read_config(path / "hf", f"model.checkpoint={path}"))}
        if isinstance(meta, dict):
            check_checkpoint_shape(path, meta, hf_config, fix)
        return
    latest = latest_checkpoint(path)
    if latest is None:
        raise InputError(f"model.checkpoint={path}: no checkpoint there; give a converted dist checkpoint "
                         "(tools/convert_ckpt/hf_to_megatron.py) or a run's checkpoints directory")
    check_checkpoint_shape(latest, read_meta(latest), hf_config, fix)


def model_shape_of(hf_config: dict) -> dict:
    from megatron_dapo.mcore.checkpoint import SHAPE_FIELDS
    from megatron_dapo.mcore.model import hf_arch

    arch = hf_arch(hf_config)
    return {k: getattr(arch, k) for k in SHAPE_FIELDS}


def check_checkpoint_shape(path: Path, meta: dict, hf_config: dict, fix: str) -> None:
    from megatron_dapo.mcore.checkpoint import check_model_shape

    check_model_shape(path, meta, model_shape_of(hf_config), fix=fix)
