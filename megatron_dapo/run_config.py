"""A run directory as the input of the commands that read a run: ``eval RUN`` and ``export RUN``, as
``samples RUN`` and ``report RUN`` read its files.

A training run writes its resolved config to ``<logging.dir>/config.yaml`` at its start; that file,
with ``logging.dir`` set to the directory given (a run read where it lies now, not where it was
written) and the command's overrides applied last, is the run's config. Reading a run changes none
of its checkpoints and records (``eval`` adds its eval.json), and the checkpoints reshard on load,
so the job's layout is the job's own: the one the run trained with where it fits this job's
processes, else one process per model (``fit_to_job``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_derived import Derived
from megatron_dapo.config_loading import load_config, override_key
from megatron_dapo.errors import ConfigError, InputError

logger = logging.getLogger("megatron_dapo.run_config")

RUN_CONFIG = "config.yaml"  # what a training run writes into its logging.dir at its start


def split_run_dir(overrides: Sequence[str]) -> tuple[Path | None, list[str]]:
    """(the run directory, the rest) when the first positional argument is not an override, else
    (None, the overrides as given). A YAML file there is left to load_config, which says it goes
    after --config; anything else that is not a directory is refused naming it."""
    first = overrides[0] if overrides else ""
    if not first or "=" in first or first.startswith("~") or first.endswith((".yaml", ".yml")):
        return None, list(overrides)
    if not Path(first).is_dir():
        raise InputError(f"{first}: no such run directory (give a training run's logging.dir, or --config FILE "
                         "naming the run)")
    return Path(first), list(overrides[1:])


def load_job_config(config: str | None, overrides: Sequence[str], *, world_size: int) -> DAPOConfig:
    """The config of a job that reads a run: from a run directory (first positional argument) or
    ``--config``, fitted to ``world_size`` processes (``fit_to_job``; the settings given on the command
    line are kept as given); one line on rank 0 for each setting fitted."""
    run_dir, rest = split_run_dir(overrides)
    if run_dir is not None and config is not None:
        raise ConfigError(f"both a run directory ({run_dir}) and --config {config}: give one (the run directory "
                          f"reads its own {RUN_CONFIG})")
    cfg = load_config(config, rest) if run_dir is None else run_config(run_dir, rest)
    given = {override_key(item) for item in rest}
    cfg, fitted = fit_to_job(cfg, world_size, given=given)
    from megatron_dapo import ranks

    if ranks.rank() == 0:
        for d in fitted:
            logger.info("derived %s", d.line())
    return cfg


def run_config(run_dir: Path, overrides: Sequence[str] = ()) -> DAPOConfig:
    """The config a run recorded, read where the run lies now; InputError naming what is missing."""
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise InputError(f"{run_dir}: no {RUN_CONFIG} in it, so not a run directory (a training run writes "
                         f"{RUN_CONFIG} into its logging.dir when it starts); give a run's directory, or --config")
    import yaml

    from megatron_dapo.config import DataConfig

    here = [f"logging.dir={json.dumps(str(run_dir))}"]  # quoted: a directory named 2024-01-01 stays a path
    if (yaml.safe_load(path.read_text()) or {}).get("toy", {}).get("enable"):
        # The demo's base and data are the run directory's own files, recorded where they were
        # made: unset, they are found again where the run lies now (toy/bootstrap.materialise).
        here += ["model.hf_path=", "data.train_files=[]", f"data.val_files={json.dumps(list(DataConfig().val_files))}"]
    return load_config(path, [*here, *overrides])


def fit_to_job(cfg: DAPOConfig, world_size: int, *, given: set[str] = frozenset()
               ) -> tuple[DAPOConfig, list[Derived]]:
    """``cfg`` made runnable by a job of ``world_size`` processes that reads the run (evaluation,
    export), and what changed. Rollouts are colocated (a reading job has no engine ranks: the
    separate placement's engines, its staleness and partial rollouts are the training loop's); a
    model-parallel layout that does not divide the world becomes one process per model, and a rollout
    TP that does not, 1. A key in ``given`` (set on the command line) is never changed: a layout
    given by hand that does not fit is refused by the layout check as for any job."""
    changes: list[Derived] = []
    why_world = f"this job has {world_size} process{'es' if world_size > 1 else ''}; checkpoints load at any layout"

    def fit(section, values: dict, name: str, why: str):
        keep = {k: v for k, v in values.items()
                if f"{name}.{k}" not in given and getattr(section, k) != v}
        changes.extend(Derived(f"{name}.{k}", getattr(section, k), v, why) for k, v in keep.items())
        return dataclasses.replace(section, **keep) if keep else section

    r = cfg.rollout
    if r.placement == "separate" or r.max_staleness or r.partial:
        r = fit(r, {"placement": "colocated", "num_ranks": 0, "max_staleness": 0, "partial": False}, "rollout",
                "a job reading the run generates in its own processes")
    if world_size % r.tensor_parallel_size:
        r = fit(r, {"tensor_parallel_size": 1}, "rollout", why_world)
    p = cfg.parallel
    if world_size % p.model_parallel_size:
        p = fit(p, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                    "virtual_pipeline_model_parallel_size": None, "sequence_parallel": False}, "parallel", why_world)
    if p.expert_pool(world_size) % p.expert_model_parallel_size:
        p = fit(p, {"expert_model_parallel_size": 1}, "parallel", why_world)
    return dataclasses.replace(cfg, rollout=r, parallel=p), changes
