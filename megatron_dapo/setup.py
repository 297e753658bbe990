"""Everything a training run needs before its first step, in one place.

Order matters: (1) the starting point is materialised once, by rank 0, before any collective (the
toy task and base model when ``toy.enable``; the Megatron conversion of ``model.hf_path`` when no
``model.checkpoint`` is given); other ranks wait for its completion marker. (2) The actor starts
torch.distributed and Megatron's parallel state and loads the latest checkpoint of the run (resume)
or else the starting weights. (3) Rank 0 builds the rollout engine and the reward pool; every rank
loads and tokenises the prompts (cheap) so the sampler state is the same everywhere.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.config import DAPOConfig

logger = logging.getLogger("megatron_dapo.setup")
DONE = ".complete"
_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "convert_ckpt"


@dataclass
class Run:
    cfg: DAPOConfig
    rank: int
    world_size: int
    dir: Path
    ckpt_dir: Path
    actor: Any
    engine: Any  # rank 0 only
    pool: Any  # rank 0 only
    tokenizer: Any
    stops: list[int]
    train_ids: list[list[int]]
    train_truths: list[str]
    val_ids: list[list[int]]
    val_truths: list[str]
    sampler: Any
    state: dict


def setup_run(cfg: DAPOConfig) -> Run:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cfg.num_threads:
        import torch

        # Tiny CPU matmuls gain nothing from threads, and with several processes on 2 cores OpenMP
        # barriers made the toy warm-up 10-20x slower (262 s vs 13-18 s measured at 1 thread).
        torch.set_num_threads(cfg.num_threads)
    run_dir = Path(cfg.logging.dir)
    cfg, hf_path, start_ckpt = _materialise_start(cfg, run_dir, rank)

    import megatron_dapo.policy  # noqa: F401  (CPU patches before megatron.core is imported)
    from transformers import AutoTokenizer, GenerationConfig

    from megatron_dapo.data import PromptSampler
    from megatron_dapo.policy.actor import MegatronActor

    hf_config = json.loads((hf_path / "config.json").read_text())
    actor = MegatronActor(cfg, hf_config)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    state = actor.load_checkpoint(str(ckpt_dir)) if cfg.checkpoint.resume == "auto" else None
    if state:
        logger.info("resumed from %s at step %d", ckpt_dir, state["step"])
    else:
        state = {}
        actor.load_checkpoint(str(start_ckpt))
        logger.info("starting weights from %s", start_ckpt)

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    stops = _stop_ids(GenerationConfig.from_pretrained(hf_path), tokenizer)
    train_ids, train_truths = _prompts(cfg.data.train_files, tokenizer, cfg)
    val_ids, val_truths = _prompts(cfg.data.val_files, tokenizer, cfg)
    sampler = PromptSampler(len(train_ids), seed=cfg.seed, shuffle=cfg.data.shuffle)
    engine = pool = None
    if rank == 0:
        from megatron_dapo.reward import RewardPool

        engine = _engine(cfg, hf_path)
        pool = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    return Run(cfg=cfg, rank=rank, world_size=world, dir=run_dir, ckpt_dir=ckpt_dir, actor=actor, engine=engine,
               pool=pool, tokenizer=tokenizer, stops=stops, train_ids=train_ids, train_truths=train_truths,
               val_ids=val_ids, val_truths=val_truths, sampler=sampler, state=state)


def _materialise_start(cfg: DAPOConfig, run_dir: Path, rank: int) -> tuple[DAPOConfig, Path, Path]:
    """Returns (cfg with resolved data files, HF dir, Megatron checkpoint to start from)."""
    if cfg.toy.enable:
        data_dir, hf_path = run_dir / "toy_data", run_dir / "toy_base"
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, train_files=(str(data_dir / "train.parquet"),), val_files=(str(data_dir / "val.parquet"),)))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(hf_path)))
        _once(run_dir / "toy", rank, lambda: _make_toy(cfg, data_dir, hf_path))
    if not cfg.model.hf_path:
        raise ValueError("model.hf_path is empty: point it at an HF model dir (config.json, tokenizer), "
                         "or set toy.enable=true for the CPU demo")
    hf_path = Path(cfg.model.hf_path)
    if cfg.model.checkpoint:
        return cfg, hf_path, Path(cfg.model.checkpoint)
    converted = run_dir / "base_megatron"
    _once(converted.with_suffix(".conversion"), rank, lambda: _convert(hf_path, converted))
    return cfg, hf_path, converted


def _once(marker_dir: Path, rank: int, fn, timeout_s: float = 3600) -> None:
    """Rank 0 runs ``fn`` unless its marker exists; other ranks wait for the marker."""
    done = marker_dir / DONE
    if rank == 0 and not done.exists():
        fn()
        marker_dir.mkdir(parents=True, exist_ok=True)
        done.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    deadline = time.time() + timeout_s
    while not done.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not finish {marker_dir} within {timeout_s} s")
        time.sleep(0.5)


def _make_toy(cfg: DAPOConfig, data_dir: Path, hf_path: Path) -> None:
    from megatron_dapo.data import toy_task
    from megatron_dapo.toy_base import make_toy_base

    t = cfg.toy
    logger.info("toy task: writing data to %s and warming up the base model in %s", data_dir, hf_path)
    train, val = toy_task.make_splits(seed=cfg.seed, num_train=t.num_train, num_val=t.num_val,
                                      num_digits=t.num_digits)
    toy_task.write_parquet(train, data_dir / "train.parquet")
    toy_task.write_parquet(val, data_dir / "val.parquet")
    make_toy_base(hf_path, seed=cfg.seed, cfg=t, eval_rows=val)


def _convert(hf_path: Path, out: Path) -> None:
    """Our converter (tools/convert_ckpt/hf_to_megatron.py), in its own process: it starts and ends
    a one-process torch.distributed world of its own."""
    cmd = [sys.executable, str(_TOOLS / "hf_to_megatron.py"), "--hf-dir", str(hf_path), "--out", str(out),
           "--force", "--no-progress"]
    logger.info("converting %s -> %s", hf_path, out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    subprocess.run(cmd, check=True, env=env)


def _prompts(files, tokenizer, cfg: DAPOConfig) -> tuple[list[list[int]], list[str]]:
    from megatron_dapo.data import apply_chat_template, filter_by_prompt_length, load_prompts

    loaded = load_prompts(list(files), dedup=cfg.data.dedup, on_bad_row=cfg.data.on_bad_row)
    ids = [apply_chat_template(tokenizer, r.chat()) for r in loaded.records]
    records, ids, dropped = filter_by_prompt_length(loaded.records, ids, cfg.data.max_prompt_length)
    logger.info("%s: %d prompts (%d rows, %d duplicates, %d too long)", ",".join(files), len(records),
                loaded.num_rows, loaded.num_duplicates, dropped)
    return ids, [r.ground_truth for r in records]


def _stop_ids(gen_cfg, tokenizer) -> list[int]:
    eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else tokenizer.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]))


def _engine(cfg: DAPOConfig, hf_path: Path):
    if cfg.rollout.engine == "hf":
        from megatron_dapo.rollout.hf_engine import HFEngine

        return HFEngine.from_pretrained(str(hf_path))
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine.from_rollout_config(str(hf_path), cfg.rollout)
