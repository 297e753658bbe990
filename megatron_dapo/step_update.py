"""A step's training half, after its rollout: pi_old (the trainer's forward, or the engine's own
log-probs), the engine/trainer mismatch, rollout correction, and the updates over mini-batches
(docs/DESIGN.md "One step"). train.Loop calls these in order.
"""

import dataclasses

import torch

from megatron_dapo.config_derived import pi_old_source
from megatron_dapo.metrics_log import MetricsLogger
from megatron_dapo.observe.step_progress import StepProgress
from megatron_dapo.off_policy import correct_samples
from megatron_dapo.rollout.partial import token_versions
from megatron_dapo.rollout.weight_sync import MISMATCH_KEYS, logprob_mismatch
from megatron_dapo.run import Run


def device_used(phase: str) -> dict[str, float]:
    """Device-wide used memory at the end of a phase (CUDA only: the engine's allocations are
    not torch's, so only the device's own count sees both), against the plan's peaks."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {f"memory/device_used_gb_{phase}": (total - free) / 1e9}


def update(run: Run, samples: list, mismatch_in_update: bool,
           progress: StepProgress | None = None) -> dict[str, float]:
    """The step's updates: its samples split into mini-batches of train.mini_batch_prompts groups
    (e.g. 512 responses -> 16 updates), train.ppo_epochs passes over them; the updates' metrics averaged
    (actor/num_updates counts them). Every update's token counts in one DP exchange before, every
    update's metrics in one after. ``mismatch_in_update``: the first update's forward measures the
    engine/trainer mismatch (train.old_log_probs=rollout: the weights that generated the batch)."""
    cfg, actor = run.cfg, run.actor
    actor.prepare_for_training()
    size = cfg.train.mini_batch_prompts * cfg.rollout.n
    minis = [samples[i:i + size] for i in range(0, len(samples), size)]
    counts = actor.batch_counts(minis)
    pending = []
    total = cfg.train.ppo_epochs * len(minis)
    if progress is not None:
        progress.phase("updating", f"{cfg.train.ppo_epochs} epochs of {len(minis)} mini-batches"
                       if cfg.train.ppo_epochs > 1 else "")
    for epoch in range(cfg.train.ppo_epochs):
        for k, mini in enumerate(minis):
            first = mismatch_in_update and epoch == k == 0
            pending.append(actor.get_loss_and_metrics(mini, mismatch=first, defer_metrics=True, counts_table=counts[k]))
            if progress is not None:
                progress.count(len(pending), total, "update")
    metrics: dict[str, float] = {}
    for k, update in enumerate(actor.reduce_metrics(pending)):
        metrics.update({key: update.pop(key) for key in MISMATCH_KEYS if mismatch_in_update and k == 0})
        _accumulate(metrics, update)
    return metrics


def _accumulate(metrics: dict, update: dict) -> None:
    """Averages per-update metrics over the step's updates (counts under actor/num_updates)."""
    n = metrics.get("actor/num_updates", 0.0)
    for k, v in update.items():
        v = float(v)
        metrics[k] = max(metrics.get(k, v), v) if k.endswith("_max") else (metrics.get(k, 0.0) * n + v) / (n + 1)
    metrics["actor/num_updates"] = n + 1


def old_log_probs(run: Run, log: MetricsLogger, samples: list, metrics: dict, groups: list,
                   step: int) -> tuple[list, bool]:
    """The samples with pi_old (train.old_log_probs): the trainer's forward over the batch, with the
    engine/trainer mismatch from it, or the engine's own log-probs (no pass; the mismatch is then
    measured in the first update's forward: the second value says so). The mismatch is measured over
    the response tokens that the trainer's weights (those of ``step``; ``groups`` in sample order)
    generated, a numerics check (a stale token's drift is rollout correction's; none current: no
    mismatch), and rollout correction applied (off_policy.py)."""
    cfg, actor = run.cfg, run.actor
    check = cfg.rollout.check_logprob_mismatch
    if pi_old_source(cfg, on_gpu=torch.cuda.is_available()) == "rollout":
        missing = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]
        if missing:
            raise ValueError(f"train.old_log_probs=rollout, but samples {missing[:8]} came without the engine's "
                             "log-probs; set train.old_log_probs=trainer")
        return [dataclasses.replace(s, old_log_probs=s.rollout_log_probs) for s in samples], check
    with log.timer("old_log_probs"):
        actor.prepare_for_inference()
        old = actor.get_inference_log_probs(samples)
        actor.finish_inference()
    current = [[v == step for v in token_versions(r)] for g in groups for r in g.rollouts]
    if check and any(map(any, current)):
        metrics.update(_mismatch([s.rollout_log_probs for s in samples], old, current))
    samples, corrected = correct_samples([dataclasses.replace(s, old_log_probs=lp) for s, lp in zip(samples, old)],
                                         cfg.algorithm.rollout_correction.spec())  # weights, rejections
    metrics.update(corrected)
    return samples, False


def _mismatch(engine_lp: list[torch.Tensor], trainer_lp: list[torch.Tensor],
              current: list[list[bool]]) -> dict[str, float]:
    pad = torch.nn.utils.rnn.pad_sequence
    mask = pad([torch.tensor(c, dtype=torch.float32) for c in current], batch_first=True)
    out = logprob_mismatch(pad(engine_lp, batch_first=True), pad(trainer_lp, batch_first=True), mask)
    return {k: float(v) for k, v in out.items()}
