"""The DAPO training loop, top to bottom (docs/DESIGN.md "One step").

Run: ``megatron-dapo train --config conf/cpu_tiny.yaml [key=value ...]``, also under
``torchrun --nproc-per-node N``. Every rank holds a share of a rollout replica: each replica
generates and scores its share of a generation batch, and the kept groups are gathered in prompt
order on every rank (rollout/placement.py), so every rank trains on the same batch and the actor
splits it over DP. Resume is automatic: a rerun of the same command continues from the latest
checkpoint.
"""

import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.algo import DynamicSampler
from megatron_dapo.collect import Group, generate_groups, rollout_metrics, to_samples
from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_loading import dump_yaml, to_dict
from megatron_dapo.eval import evaluate
from megatron_dapo.metrics_log import MetricsLogger, format_progress
from megatron_dapo.reward import VALUE_REWARD_FN
from megatron_dapo.rollout.engine import Rollout, eval_sampling_params, rollout_sampling_params
from megatron_dapo.rollout.weight_sync import logprob_mismatch
from megatron_dapo.setup import Run, setup_run

logger = logging.getLogger("megatron_dapo.train")
_PLOT = Path(__file__).resolve().parents[1] / "tools" / "plot_metrics.py"


def train(cfg: DAPOConfig) -> dict[str, float]:
    """Runs (or resumes) DAPO training; returns the last evaluation's metrics (on every rank)."""
    run: Run = setup_run(cfg)
    actor, placement = run.actor, run.placement
    dyn = DynamicSampler(prompts_per_step=cfg.data.prompts_per_step, group_size=cfg.rollout.n,
                         max_num_gen_batches=cfg.algorithm.filter_groups.max_num_gen_batches,
                         enabled=cfg.algorithm.filter_groups.enable, surplus=cfg.algorithm.filter_groups.surplus)
    # Without dynamic sampling every group is kept: a generation batch is the step's prompts.
    gen_batch = cfg.data.gen_prompts_per_batch if dyn.enabled else cfg.data.prompts_per_step
    start = run.state.get("step", 0)
    if run.state:
        run.sampler.load_state_dict(run.state["sampler"])
        dyn.load_state_dict({"held": [_group_from_dict(g) for g in run.state["held_groups"]]})
    # Records are numbered by completed steps; a checkpoint at step N already holds step N's
    # record, so a resume drops only what came after it (a fresh run drops everything).
    log = MetricsLogger(run.dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                        wandb_project=cfg.logging.wandb_project, config=to_dict(cfg), enabled=run.rank == 0,
                        start_step=start + 1 if start else 0)
    if run.rank == 0:
        (run.dir / "config.yaml").write_text(dump_yaml(cfg))
    _sync(run)  # the engines start from the checkpoint's weights (vLLM's from dummy ones)
    final = {}
    if cfg.eval.before_train and start == 0:
        final = _log(log, 0, _evaluate(run, cfg), cfg, start)

    for step in range(start, cfg.train.total_steps):
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        with log.timer("rollout"):
            dyn.start_step()
            while not dyn.is_full:  # dynamic sampling: draw generation batches until the batch is full
                indices = run.sampler.next_indices(gen_batch)
                params = rollout_sampling_params(cfg.rollout, seed=_seed(cfg, step, dyn), stop_token_ids=run.stops)
                groups, acc = generate_groups(placement, run.train_ids, indices, ground_truths=run.train_truths,
                                              tokenizer=run.tokenizer, params=params, pool=run.pool, cfg=cfg,
                                              keep=dyn.keep_mask)
                dyn.add(groups, acc)
            groups, ds_metrics = dyn.pop()
        placement.sleep()  # the engine's memory goes to the trainer until the next sync
        metrics.update(ds_metrics | rollout_metrics(groups))
        samples = to_samples(groups, cfg)

        with log.timer("old_log_probs"):
            actor.prepare_for_inference()
            old = actor.get_inference_log_probs(samples)
            actor.finish_inference()
        if cfg.rollout.check_logprob_mismatch:
            metrics.update(_mismatch([s.rollout_log_probs for s in samples], old))
        samples = [dataclasses.replace(s, old_log_probs=lp) for s, lp in zip(samples, old)]

        with log.timer("train"):
            actor.prepare_for_training()
            size = cfg.train.mini_batch_prompts * cfg.rollout.n
            for _ in range(cfg.train.ppo_epochs):
                for i in range(0, len(samples), size):  # e.g. 512 responses -> 16 updates per step
                    _accumulate(metrics, actor.get_loss_and_metrics(samples[i:i + size]))
        with log.timer("weight_sync"):
            _sync(run)
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0 or step + 1 == cfg.train.total_steps:
            with log.timer("eval"):
                metrics.update(_evaluate(run, cfg))
        metrics["timing_s/step"] = time.perf_counter() - step_start
        # Log before saving: a crash between the two resumes from the previous checkpoint and
        # rewrites this step's record, never leaves a step without one.
        final = _log(log, step + 1, metrics, cfg, start) or final
        if cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0 \
                or step + 1 == cfg.train.total_steps:
            held = [dataclasses.asdict(g) for g in dyn.state_dict()["held"]]
            actor.save_checkpoint(str(run.ckpt_dir), {"step": step + 1, "sampler": run.sampler.state_dict(),
                                                      "held_groups": held})
    log.close()
    if run.pool is not None:
        run.pool.close()
    return final


def _sync(run: Run) -> None:
    """Streams the trained weights into every rank's engine (so into every replica); every rank
    runs the export's collectives."""
    run.placement.sync(run.actor.export_hf_weights(), run.cfg.rollout.weight_sync_bucket_mb << 20)


def _evaluate(run: Run, cfg: DAPOConfig) -> dict[str, float]:
    params = eval_sampling_params(cfg.eval, seed=cfg.seed, stop_token_ids=run.stops)
    return evaluate(run.placement, run.val_ids, run.val_truths, tokenizer=run.tokenizer, params=params,
                    n=cfg.eval.n, pool=run.pool, reward_fn=cfg.eval.reward_fn, value_fn=VALUE_REWARD_FN)


def _log(log: MetricsLogger, step: int, metrics: dict, cfg: DAPOConfig, start: int) -> dict[str, float]:
    values = log.log(step, metrics)
    if log.enabled and cfg.logging.progress:
        print(format_progress(step, values, total_steps=cfg.train.total_steps), flush=True)
    return {k: v for k, v in values.items() if k.startswith("eval/")}


def _accumulate(metrics: dict, update: dict) -> None:
    """Averages per-update metrics over the step's updates (counts under actor/num_updates)."""
    n = metrics.get("actor/num_updates", 0.0)
    for k, v in update.items():
        v = float(v)
        metrics[k] = max(metrics.get(k, v), v) if k.endswith("_max") else (metrics.get(k, 0.0) * n + v) / (n + 1)
    metrics["actor/num_updates"] = n + 1


def _mismatch(engine_lp: list[torch.Tensor], trainer_lp: list[torch.Tensor]) -> dict[str, float]:
    pad = torch.nn.utils.rnn.pad_sequence
    mask = pad([torch.ones(len(x)) for x in engine_lp], batch_first=True)
    out = logprob_mismatch(pad(engine_lp, batch_first=True), pad(trainer_lp, batch_first=True), mask)
    return {k: float(v) for k, v in out.items()}


def _seed(cfg: DAPOConfig, step: int, dyn: DynamicSampler) -> int:
    """Rollout seed of this step's next generation batch: reproducible across a resume."""
    return (cfg.seed * 1_000_003 + step) * 1_009 + dyn.num_gen_batches


def _group_from_dict(d: dict) -> Group:
    return Group(**{**d, "rollouts": [Rollout(**r) for r in d["rollouts"]]})


def evaluate_run(cfg: DAPOConfig) -> dict[str, float]:
    """``megatron-dapo eval``: the run's latest checkpoint (or its starting weights) on data.val_files,
    with the eval settings; writes <logging.dir>/eval.json on rank 0."""
    run = setup_run(cfg)
    _sync(run)
    result = {"step": run.state.get("step", 0), **_evaluate(run, cfg)}
    if run.rank == 0:
        (run.dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        print("evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(result.items())), flush=True)
    if run.pool is not None:
        run.pool.close()
    return result


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-parameter and config dumps


def main(cfg: DAPOConfig) -> int:
    setup_logging()
    final = train(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("final evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(final.items())), flush=True)
        run_dir = Path(cfg.logging.dir)
        subprocess.run([sys.executable, str(_PLOT), "--metrics", str(run_dir / "metrics.jsonl"),
                        "--out", str(run_dir / "curves.png")], check=False)
    return 0

