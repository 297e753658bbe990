"""The CPU demo's inputs, made inside the run directory on first use (``toy.enable``).

``materialise`` is the one call the trainer's set-up makes: it writes the toy task's train and
validation parquet files to ``<run>/toy_data`` and warms up the tiny base model into
``<run>/toy_base``, then returns the config pointed at them, so everything after it (the loader,
tokenizer, actor, engines) runs the same path as a real Qwen2.5 run. Rank 0 does the work once;
other ranks wait for its completion marker ``<run>/toy/.complete``, which records the toy settings:
a rerun with other settings is refused (``check``) instead of silently training the old model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from megatron_dapo.config import DAPOConfig
from megatron_dapo.errors import InputError

logger = logging.getLogger("megatron_dapo.toy")
DONE = ".complete"


def check(cfg: DAPOConfig, run_dir: Path) -> None:
    """Read-only: InputError when ``run_dir`` was made with other toy settings than ``cfg``'s."""
    done = run_dir / "toy" / DONE
    if not done.exists():
        return
    try:
        before = json.loads(done.read_text())
    except ValueError:  # a marker of an older version (a time stamp): nothing to compare
        return
    diff = {k: (before.get(k), v) for k, v in _record(cfg).items() if before.get(k, v) != v}
    if diff:
        changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
        raise InputError(f"{run_dir} was made with other toy settings ({changes}; run dir -> "
                         "this command): use a new logging.dir, or the settings it was made with")


def materialise(cfg: DAPOConfig, run_dir: Path, rank: int, *, timeout_s: float = 3600) -> DAPOConfig:
    """``cfg`` with ``data.*_files`` and ``model.hf_path`` pointing at the toy's files, made by
    rank 0 unless the marker says they exist; other ranks wait up to ``timeout_s`` for it."""
    check(cfg, run_dir)
    data_dir, hf_path = run_dir / "toy_data", run_dir / "toy_base"
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, train_files=(str(data_dir / "train.parquet"),),
                                      val_files=(str(data_dir / "val.parquet"),)),
        model=dataclasses.replace(cfg.model, hf_path=str(hf_path)))
    done = run_dir / "toy" / DONE
    if rank == 0 and not done.exists():
        _make(cfg, data_dir, hf_path)
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(_record(cfg), sort_keys=True) + "\n")
    deadline = time.time() + timeout_s
    while not done.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not make the toy inputs ({done}) within {timeout_s} s")
        time.sleep(0.5)
    return cfg


def _record(cfg: DAPOConfig) -> dict:
    return {"seed": cfg.seed, **dataclasses.asdict(cfg.toy)}


def _make(cfg: DAPOConfig, data_dir: Path, hf_path: Path) -> None:
    from megatron_dapo.toy import task
    from megatron_dapo.toy.base import make_toy_base

    t = cfg.toy
    logger.info("toy task: writing data to %s and warming up the base model in %s", data_dir, hf_path)
    train, val = task.make_splits(seed=cfg.seed, num_train=t.num_train, num_val=t.num_val, num_digits=t.num_digits,
                                  min_digits=t.min_digits)
    task.write_parquet(train, data_dir / "train.parquet")
    task.write_parquet(val, data_dir / "val.parquet")
    make_toy_base(hf_path, seed=cfg.seed, cfg=t, eval_rows=val)
