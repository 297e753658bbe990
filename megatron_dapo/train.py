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
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_dapo import ranks
from megatron_dapo.algo import DynamicSampler
from megatron_dapo.gen_batches import GenerationBatches
from megatron_dapo.groups import rollout_metrics, to_samples, version_lag
from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_loading import dump_yaml, to_dict
from megatron_dapo.eval import evaluate_with_rows
from megatron_dapo.metrics_log import MetricsLogger, format_progress, progress_keys, read_metrics
from megatron_dapo.observe.observer import Observer
from megatron_dapo.off_policy import correct_samples
from megatron_dapo.observe.profiler import StepProfiler
from megatron_dapo.preemption import ABANDON_SAFETY_S, TIME_LIMIT, StopRequest, Watch
from megatron_dapo.reward import VALUE_REWARD_FN
from megatron_dapo.rollout.engine import eval_sampling_params
from megatron_dapo.rollout.partial import partial_metrics, token_versions
from megatron_dapo.rollout.pipeline import RolloutPipeline
from megatron_dapo.rollout.weight_sync import MISMATCH_KEYS, logprob_mismatch
from megatron_dapo.run import Run, build_run, check_settings, prepare_run
from megatron_dapo.time_limit import StepClock, job_end_time, write_status
from megatron_dapo.trainer_state import TrainerState

logger = logging.getLogger("megatron_dapo.train")


@dataclass
class TrainResult:
    final_eval: dict[str, float]  # the last evaluation's metrics of this invocation ({} if none ran)
    step: int  # completed steps
    stopped_by: str | None = None  # the signal's name when a signal stopped the run early
    checkpoint: str | None = None  # the newest checkpoint when stopped by a signal
    already_complete: bool = False  # nothing to do: the run was at train.total_steps when started
    stop_latency_s: float = 0.0  # from the signal to the saved checkpoint
    engine_rank: bool = False  # rollout.placement=separate: this rank served generations only (step 0)


def train(cfg: DAPOConfig, stop: StopRequest | None = None) -> TrainResult:
    """Runs (or resumes) DAPO training. SIGTERM, SIGUSR1 and Ctrl-C stop it after the current
    step with a checkpoint (preemption.py); ``stop``: handlers installed by the caller, else here."""
    own = stop is None
    stop = StopRequest().install() if own else stop
    run = engines = None
    try:
        if cfg.rollout.placement == "separate":  # the engines' ranks leave here (rollout/separate.py)
            from megatron_dapo.rollout.engine_server import serve
            from megatron_dapo.rollout.separate import Engines
            from megatron_dapo.rollout.worlds import sides, split_world

            check_settings(cfg, sides(cfg.rollout, ranks.world_size())[1])  # every rank, before any group
            split = split_world(cfg.rollout.num_ranks, tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                                timeout_minutes=cfg.parallel.timeout_minutes,
                                wait_minutes=cfg.rollout.wait_timeout_minutes)
            if not split.is_trainer:
                try:
                    served = serve(split)
                except Exception as error:
                    if stop.signum is None:
                        raise
                    # A signal's grace ran out and the trainers left mid-exchange: as they do, exit 0
                    # (the launcher requeues on 0), the checkpoint is theirs; named: it may be the engine's.
                    logger.warning("engine rank %d: the trainers left after %s (%s: %s)", split.side_rank,
                                   stop.name, type(error).__name__, str(error)[:300])
                    served = -1
                logger.info("engine rank %d: served %d generation requests", split.side_rank, served)
                return TrainResult(final_eval={}, step=0, engine_rank=True)
            engines = Engines(split)  # told to stop however the trainers end
        # From here on only the config as set-up resolved it (the demo's data files and base
        # filled in): what runs, and what config.yaml and W&B record.
        prep = prepare_run(cfg, engines=engines)
        cfg = prep.cfg
        if prep.resume is not None and _finished(cfg, prep.resume.step, prep.resume.responses_generated):
            prep.release()  # nothing to build: the checkpoint it would resume from ends the run
            return TrainResult(final_eval=_last_eval(prep.dir), step=prep.resume.step, already_complete=True)
        run = build_run(prep)
        result = _train(run, stop)
        if run.rank == 0:  # for the launcher: requeue the job while the run is unfinished
            write_status("stopped" if result.stopped_by else "finished",
                         f"after step {result.step} of {run.cfg.train.total_steps}"
                         + (f", by {result.stopped_by}; checkpoint {result.checkpoint}" if result.stopped_by else ""))
        return result
    finally:
        try:
            if own:
                stop.restore()
            if run is not None:
                run.close()
        finally:
            if engines is not None:  # told even when the run's own teardown raised; after a failure
                engines.shutdown(failed=sys.exc_info()[0] is not None)  # its links are aborted, not shut down


def _train(run: Run, stop: StopRequest) -> TrainResult:
    cfg = run.cfg
    dyn = DynamicSampler(prompts_per_step=cfg.data.prompts_per_step, group_size=cfg.rollout.n,
                         max_num_gen_batches=cfg.algorithm.filter_groups.max_num_gen_batches,
                         enabled=cfg.algorithm.filter_groups.enable, surplus=cfg.surplus,
                         adaptive=cfg.algorithm.filter_groups.adaptive,
                         max_request=cfg.algorithm.filter_groups.max_gen_prompts,
                         on_exhausted=cfg.algorithm.filter_groups.on_exhausted)
    # Without dynamic sampling every group is kept: a generation batch is the step's prompts.
    gen_batch = cfg.data.gen_prompts_per_batch if dyn.enabled else cfg.data.prompts_per_step
    resume = run.resume
    start = resume.step if resume else 0
    pipeline = RolloutPipeline(cfg.rollout.max_staleness, cfg.train.total_steps, cfg.checkpoint.save_every)
    if resume:
        run.sampler.load_state_dict(resume.sampler)
        dyn.restore_held(resume.held_groups, resume.keep_rate)
        pipeline.restore(list(resume.ahead))
    # Records are numbered by completed steps; a checkpoint at step N already holds step N's
    # record, so a resume drops only what came after it (a fresh run drops everything).
    log = MetricsLogger(run.dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                        wandb_project=cfg.logging.wandb_project, config=to_dict(cfg), enabled=run.rank == 0,
                        start_step=start + 1 if start else 0)
    clock = StepClock()
    clock.load_state_dict(resume.clock if resume else {})
    end_time = job_end_time(scontrol=run.rank == 0)  # rank 0 asks SLURM; the stop all-reduce tells the rest
    # From the first step on, a signal whose grace cannot hold the step in flight abandons it.
    stop.watch(Watch(seconds_to_finish=clock.seconds_to_finish, last_checkpoint=lambda: str(_latest(run) or "none yet"),
                     on_abandon=lambda line: _on_abandon(run, line),
                     grace_s=cfg.checkpoint.stop_grace_s, end_time=end_time))
    obs = Observer(cfg, run.dir, rank=run.rank, start=start, num_replicas=run.placement.num_replicas, resume=resume,
                   log=log)
    gen = GenerationBatches(run, obs, resume.carried if resume else ())
    try:
        with StepProfiler(cfg.profile, run.dir, run.rank) as prof:  # profile.steps: a trace of those steps
            return _loop(run, stop, dyn, pipeline, gen, log, obs, prof, start, gen_batch, clock, end_time)
    finally:
        log.close()
        run.actor.onload_after_rollout()  # the run's last evaluation may have left the state off


def _loop(run: Run, stop: StopRequest, dyn: DynamicSampler, pipeline: RolloutPipeline, gen: GenerationBatches,
          log: MetricsLogger, obs: Observer, prof: StepProfiler, start: int, gen_batch: int, clock: StepClock,
          end_time: float | None) -> TrainResult:
    cfg, actor, placement = run.cfg, run.actor, run.placement
    _record_ranks(run)
    if run.rank == 0:
        (run.dir / "config.yaml").write_text(dump_yaml(cfg))
    _sync(run, start, clock)  # the engines start from the checkpoint's weights (vLLM's from dummy ones)
    final = {}
    if cfg.eval.before_train and start == 0:
        actor.offload_for_rollout()  # the engine generates: the state goes off as for a step's rollouts
        eval_start = time.monotonic()
        metrics = _evaluate(run, obs)
        clock.record_eval(time.monotonic() - eval_start)  # the time limit's estimate of the first eval step
        final = _log(log, 0, metrics | obs.end_step(0, metrics, [], []), cfg, start)

    done = saved = start  # completed steps; the step the newest checkpoint holds
    generated = run.resume.responses_generated if run.resume else 0  # every response generated so far, kept or not
    finished = False  # at total_steps, or the generation budget spent
    for step in range(start, cfg.train.total_steps):
        evaluates = _evaluates(cfg, step + 1)
        if end_time is not None and not clock.next_step_fits(end_time, cfg.checkpoint.time_limit_margin_s,
                                                             evaluates=evaluates):
            stop.request(TIME_LIMIT)  # the next step (its evaluation too) and its save would end past the job's end
        if stop.agreed():  # every rank stops after the same step
            break
        clock.start_step(evaluates)
        prof.begin_step(step + 1)
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        if cfg.actor.offload_during_rollout:
            with log.timer("offload"):  # the engine generates in the trainer's grads' and optimizer's memory
                metrics.update(actor.offload_for_rollout())
        with log.timer("rollout"):
            dyn.start_step()
            # dynamic sampling: draw generation batches until the batch is full, and take the batch asked
            # for in an earlier step even when groups carried over (surplus=carry) already fill it
            while not dyn.is_full or pipeline.has(step):
                ahead = pipeline.take(step)
                if ahead is None:
                    ahead = gen.draw(step, dyn.num_gen_batches, dyn.request_size(gen_batch))
                batch, indices = gen.generate(ahead, keep=dyn.keep_mask, rows=obs.row_spec(dyn.num_gen_batches),
                                              carry_all=dyn.carries_all())
                obs.add_batch(batch, indices)
                dyn.add(batch.groups, batch.acc)
            groups, ds_metrics = dyn.pop()
            if cfg.rollout.partial:  # the carry before a batch asked for ahead takes it
                if cfg.rollout.partial_unfinished == "abort":  # the groups still growing are dropped
                    ds_metrics["rollout/aborted_tokens"] = float(gen.abort_carry())
                ds_metrics.update(partial_metrics(groups, gen.carry, step))
        metrics.update(_device_used("generating"))
        placement.sleep()  # the engine's memory goes to the trainer until the next sync
        if cfg.actor.offload_during_rollout:
            with log.timer("onload"):  # after the sleep: the engine's memory is free for the state again
                actor.onload_after_rollout()
        generated += int(ds_metrics["dynamic_sampling/num_groups_generated"]) * cfg.rollout.n
        finished = _finished(cfg, step + 1, generated)
        if finished:
            pipeline.drop(gen.cancel)  # a generation budget spent: batches asked for ahead will not be trained on
        last = finished or (pipeline.max_staleness > 0  # the job's end: nothing to wait for at its stop
                            and placement.gather([_job_ends_after_next(cfg, clock, end_time, step, evaluates)])[0])
        for ahead in [] if last or cfg.rollout.placement != "separate" else pipeline.released(step):
            gen.submit(ahead)  # a stop released them: asked for again, in order (else in their steps)
        for target in pipeline.targets(step, finished=last):  # generated while this step trains
            # no new prompts when the groups carried over (surplus=carry) fill every step up to it
            ahead = gen.draw(target, 0, dyn.ahead_request_size(gen_batch, target - step))
            if ahead.indices or ahead.carried:
                gen.submit(ahead)
                pipeline.add(ahead)
        metrics.update(ds_metrics | rollout_metrics(groups) | version_lag(groups, step))
        metrics["rollout/responses_generated_total"] = generated
        samples = to_samples(groups, cfg)

        current = [[v == step for v in token_versions(r)] for g in groups for r in g.rollouts]
        samples, mismatch_in_update = _old_log_probs(run, log, samples, metrics, current)
        with log.timer("train"):
            actor.prepare_for_training()
            size = cfg.train.mini_batch_prompts * cfg.rollout.n
            minis = [samples[i:i + size] for i in range(0, len(samples), size)]  # e.g. 512 responses -> 16
            counts = actor.batch_counts(minis)  # every update's token counts: one DP exchange a step
            pending = []  # and the updates' metrics, one exchange after them
            for epoch in range(cfg.train.ppo_epochs):
                for k, mini in enumerate(minis):
                    first = mismatch_in_update and epoch == k == 0  # the weights that generated them
                    pending.append(actor.get_loss_and_metrics(mini, mismatch=first, defer_metrics=True,
                                                              counts_table=counts[k]))
            for k, update in enumerate(actor.reduce_metrics(pending)):
                first = mismatch_in_update and k == 0
                metrics.update({key: update.pop(key) for key in MISMATCH_KEYS if first})
                _accumulate(metrics, update)
        metrics.update(_device_used("training"))
        pending, write_s = _write_if_due(run, log, step + 1, finished)
        # the engines take the new weights after what is in flight (timing_s/trainer_waited); at a stop,
        # only as long as the rest of the step and the save still end before the kill
        gen.await_in_flight(pipeline, stop, reserve_s=clock.rest_after_wait(evaluates) + 2 * ABANDON_SAFETY_S)
        with log.timer("weight_sync"):
            _sync(run, step + 1, clock)
        eval_s = 0.0
        if evaluates or finished:
            eval_start = time.monotonic()
            with log.timer("eval"):
                actor.offload_for_rollout()  # off until the next old log-probs (publish reads no state)
                metrics.update(_evaluate(run, obs))
            eval_s = time.monotonic() - eval_start
        metrics.update(placement.take_waits())
        metrics["timing_s/step"] = time.perf_counter() - step_start
        metrics.update(obs.end_step(step + 1, metrics, groups, [s.advantages for s in samples]))
        # Log before saving: a crash between the two resumes from the previous checkpoint and
        # rewrites this step's record, never leaves a step without one.
        final = _log(log, step + 1, metrics, cfg, start) or final
        done = step + 1
        prof.end_step(done)
        clock.end_step(eval_seconds=eval_s)
        if pending is not None:
            _save(run, dyn, pipeline, gen, obs, done, generated, clock, pending, write_s)
            saved = done
        if finished:
            break
    if stop.signum is None or finished:
        return TrainResult(final_eval=final, step=done)
    if done > saved:
        actor.onload_after_rollout()  # an evaluation may have left the state off
        gen.collect_in_flight(pipeline)  # kept with the checkpoint
        _save(run, dyn, pipeline, gen, obs, done, generated, clock)
    stop.saved()  # the last step is saved: the watchdog stands down
    latest = _latest(run)
    return TrainResult(final_eval=final, step=done, stopped_by=stop.name, checkpoint=latest and str(latest),
                       stop_latency_s=stop.seconds_since())


def _record_ranks(run: Run) -> None:
    """<logging.dir>/ranks.json: each rank's node (SLURM's node name, else the host name), in rank
    order, for the invocation that runs now: where to look when one rank misbehaves."""
    nodes = run.placement.gather_all(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    if run.rank == 0:
        (run.dir / "ranks.json").write_text(json.dumps({"nodes": nodes}, indent=1) + "\n")


def _on_abandon(run: Run, line: str) -> None:
    """A step abandoned at a stop (preemption.py: the process exits next): rank 0 leaves its status
    for the launcher and closes its channels, so that the engines and the other trainer ranks waiting
    for its next message end at once instead of waiting out rollout.wait_timeout_minutes."""
    if run.rank == 0:
        write_status("stopped", line)
        if run.engines is not None:
            run.engines.close_channels()


def _write_if_due(run: Run, log: MetricsLogger, step: int, finished: bool):
    """(the pending checkpoint of ``step`` or None when no save is due, the seconds it took): a save's
    tensors are written after the updates, while the engine sleeps and the state is on the device,
    and published after the step is logged."""
    every = run.cfg.checkpoint.save_every
    if not (every and step % every == 0 or finished):
        return None, 0.0
    with log.timer("checkpoint_write"):
        started = time.monotonic()
        pending = run.actor.write_checkpoint(str(run.ckpt_dir), step)
    return pending, time.monotonic() - started


def _save(run: Run, dyn: DynamicSampler, pipeline: RolloutPipeline, gen: GenerationBatches, obs: Observer,
          step: int, generated: int, clock: StepClock, pending=None, write_s: float = 0.0) -> None:
    """Publishes ``pending`` (the step's tensors, written before the sync ``write_s`` ago) with the
    trainer state; without one (a stop between steps), saves in one go. The clock records the whole
    save, both halves: it is what the stop path's one-phase save will cost (the saving step's time
    holds the write too, which only makes the time-limit estimate safer)."""
    state = TrainerState(step=step, sampler=run.sampler.state_dict(), held_groups=dyn.held,
                         responses_generated=generated, clock=clock.state_dict(), ledger=obs.ledger.state(),
                         keep_rate=dyn.keep_rate,
                         alarms=tuple(obs.alarms.state()), ahead=tuple(pipeline.to_json()),
                         carried=tuple(gen.carry_json()))
    started = time.monotonic()
    if pending is None:
        run.actor.save_checkpoint(str(run.ckpt_dir), state.to_json())
    else:
        run.actor.publish_checkpoint(pending, state.to_json())
    clock.record_save(write_s + time.monotonic() - started)


def _evaluates(cfg: DAPOConfig, step: int) -> bool:
    """Whether step ``step`` (from 1) ends with an evaluation (eval.every, and the last step; a
    generation budget's last step is known only once it ran)."""
    return bool(cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.total_steps


def _finished(cfg: DAPOConfig, steps: int, generated: int) -> bool:
    """Nothing left to do after ``steps`` steps and ``generated`` responses: train.total_steps
    reached, or the generation budget spent."""
    return steps >= cfg.train.total_steps or 0 < cfg.train.generation_budget <= generated


def _latest(run: Run) -> Path | None:
    from megatron_dapo.mcore.checkpoint import latest_checkpoint

    return latest_checkpoint(run.ckpt_dir)


def _last_eval(run_dir: Path) -> dict[str, float]:
    path = run_dir / "metrics.jsonl"
    records = [r for r in read_metrics(path) if any(k.startswith("eval/") for k in r)] if path.exists() else []
    return {k: v for k, v in records[-1].items() if k.startswith("eval/") and v is not None} if records else {}


def _sync(run: Run, version: int | None = None, clock: StepClock | None = None) -> None:
    """Streams the trained weights (``version``: the steps trained into them) into every rank's
    engine (so into every replica); every rank runs the export's collectives. One bucket size for
    both halves: the export gathers a bucket of full tensors at a time, and the engine loads the
    same buckets. ``clock`` records how long it took (a stop's wait leaves room for the next)."""
    started = time.monotonic()
    bucket_bytes = run.cfg.rollout.weight_sync_bucket_mb << 20
    run.placement.sync(run.actor.export_hf_weights(bucket_bytes=bucket_bytes), bucket_bytes, version=version)
    if clock is not None:
        clock.record_sync(time.monotonic() - started)


def _job_ends_after_next(cfg: DAPOConfig, clock: StepClock, end_time: float | None, step: int,
                         evaluates: bool) -> bool:
    """Whether the job's end will stop the run after step ``step + 1`` (the one after this): this
    step's rest (at most a step, and its evaluation) and the next one with its save would not fit.
    Then nothing is asked for ahead, and the time-limit stop has nothing in flight to wait for. Rank
    0's answer is every rank's (the caller gathers it): only rank 0 may know the job's end."""
    if end_time is None:
        return False
    this_ends = time.time() + (clock.step_estimate or 0.0) + ((clock.eval or 0.0) if evaluates else 0.0)
    return not clock.next_step_fits(end_time, cfg.checkpoint.time_limit_margin_s, now=this_ends,
                                    evaluates=_evaluates(cfg, step + 2))


def _evaluate(run: Run, obs: Observer | None = None) -> dict[str, float]:
    """Held-out metrics; with ``obs``, its dump rows go to the step's samples."""
    cfg = run.cfg
    params = eval_sampling_params(cfg.eval, max_tokens=cfg.eval_max_response_length, seed=cfg.seed,
                                  stop_token_ids=run.inputs.stops)
    inputs = run.inputs
    metrics, rows = evaluate_with_rows(run.placement, inputs.val_ids, inputs.val_truths, tokenizer=inputs.tokenizer,
                                       params=params, n=cfg.eval.n, pool=run.pool, reward_fn=cfg.eval.reward_fn,
                                       value_fn=VALUE_REWARD_FN, rows=obs.eval_spec() if obs else None)
    if obs is not None:
        obs.add_eval(rows)
    return metrics


def _log(log: MetricsLogger, step: int, metrics: dict, cfg: DAPOConfig, start: int) -> dict[str, float]:
    values = log.log(step, metrics)
    if log.enabled and cfg.logging.progress:
        print(format_progress(step, values, total_steps=cfg.train.total_steps, keys=progress_keys(cfg.eval.n)),
              flush=True)
    return {k: v for k, v in values.items() if k.startswith("eval/")}


def _device_used(phase: str) -> dict[str, float]:
    """Device-wide used memory at the end of a phase (CUDA only: the engine's allocations are
    not torch's, so only the device's own count sees both), against the plan's peaks."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {f"memory/device_used_gb_{phase}": (total - free) / 1e9}


def _accumulate(metrics: dict, update: dict) -> None:
    """Averages per-update metrics over the step's updates (counts under actor/num_updates)."""
    n = metrics.get("actor/num_updates", 0.0)
    for k, v in update.items():
        v = float(v)
        metrics[k] = max(metrics.get(k, v), v) if k.endswith("_max") else (metrics.get(k, 0.0) * n + v) / (n + 1)
    metrics["actor/num_updates"] = n + 1


def _old_log_probs(run: Run, log: MetricsLogger, samples: list, metrics: dict,
                   current: list[list[bool]]) -> tuple[list, bool]:
    """The samples with pi_old (train.old_log_probs): the trainer's forward over the batch, with the
    engine/trainer mismatch from it, or the engine's own log-probs (no pass; the mismatch is then
    measured in the first update's forward: the second value says so). ``current``: per sample and
    response token, whether the trainer's weights generated it: the mismatch is measured over those
    only, a numerics check (a stale token's drift is rollout correction's; none current: no mismatch),
    and rollout correction applied (off_policy.py)."""
    cfg, actor = run.cfg, run.actor
    check = cfg.rollout.check_logprob_mismatch
    if cfg.train.old_log_probs == "rollout":
        missing = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]
        if missing:
            raise ValueError(f"train.old_log_probs=rollout, but samples {missing[:8]} came without the engine's "
                             "log-probs; set train.old_log_probs=trainer")
        return [dataclasses.replace(s, old_log_probs=s.rollout_log_probs) for s in samples], check
    with log.timer("old_log_probs"):
        actor.prepare_for_inference()
        old = actor.get_inference_log_probs(samples)
        actor.finish_inference()
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


def evaluate_run(cfg: DAPOConfig) -> dict[str, float]:
    """``megatron-dapo eval``: the run's latest checkpoint (or its starting weights) on data.val_files,
    with the eval settings; writes <logging.dir>/eval.json on rank 0. Reads a live run: it does
    not take the run directory's lock."""
    run = build_run(prepare_run(cfg, lock=False))
    try:
        _sync(run)
        result = {"step": run.resume.step if run.resume else 0, **_evaluate(run)}
    finally:
        run.close()
    if run.rank == 0:
        run.dir.mkdir(parents=True, exist_ok=True)  # evaluating an HF dir: a fresh logging.dir
        (run.dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        print("evaluation: " + _fmt(result), flush=True)
    return result


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-parameter and config dumps


def main(cfg: DAPOConfig, stop: StopRequest | None = None) -> int:
    from megatron_dapo.observe.report import write_report
    from megatron_dapo.plotting import plot_run

    setup_logging()
    result = train(cfg, stop)
    if result.engine_rank or ranks.rank() != 0:  # a finished run never starts torch.distributed
        return 0
    if result.already_complete:
        budget = f" or train.generation_budget={cfg.train.generation_budget}" if cfg.train.generation_budget else ""
        print(f"nothing to do: {cfg.logging.dir} is already at step {result.step} of train.total_steps="
              f"{cfg.train.total_steps}{budget} (raise it to train on); its last evaluation: "
              f"{_fmt(result.final_eval) or 'none'}", flush=True)
        return 0
    plot_run(cfg.logging.dir)
    write_report(cfg.logging.dir)  # curves, the latest samples, the alarms: one page
    if result.stopped_by:
        saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint yet (nothing to keep)"
        print(f"megatron-dapo: stopped by {result.stopped_by} after step {result.step} of "
              f"{cfg.train.total_steps} ({result.stop_latency_s:.1f} s after the signal): {saved}; rerun the "
              "same command to resume", flush=True)
    else:
        print("final evaluation: " + _fmt(result.final_eval), flush=True)
    return 0


def _fmt(values: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(values.items()))
