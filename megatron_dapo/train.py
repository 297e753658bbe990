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
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo import ranks
from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_derived import comments
from megatron_dapo.config_loading import dump_yaml, to_dict
from megatron_dapo.eval import evaluate_with_rows
from megatron_dapo.groups import to_samples
from megatron_dapo.metrics_log import MetricsLogger, format_progress, progress_keys, read_metrics
from megatron_dapo.observe.observer import Observer
from megatron_dapo.observe.profiler import StepProfiler
from megatron_dapo.observe.step_progress import StepProgress
from megatron_dapo.preemption import StopRequest, Watch
from megatron_dapo.reward import VALUE_REWARD_FN
from megatron_dapo.rollout.engine import GenerationAborted, eval_sampling_params
from megatron_dapo.run import EvalOnly, Run, build_run, prepare_run
from megatron_dapo.schedule import StepSchedule, finished
from megatron_dapo.step_batches import StepBatches
from megatron_dapo.step_saves import StepSaves
from megatron_dapo.step_update import device_used, old_log_probs, update
from megatron_dapo.time_limit import StepClock, job_end_time, write_status
from megatron_dapo.trainer_state import TrainerState

logger = logging.getLogger("megatron_dapo.train")
CUT_EXIT_S = 2.0  # a cut step's way out of its generation, before its save (Loop.seconds_to_save)


@dataclass
class TrainResult:
    final_eval: dict[str, float]  # the last evaluation's metrics of this invocation ({} if none ran)
    step: int  # completed steps
    stopped_by: str | None = None  # the signal's name when a signal stopped the run early
    cut: int | None = None  # the step (from 1) whose generation a stop cut short, redone on resume
    checkpoint: str | None = None  # the newest checkpoint when stopped by a signal
    already_complete: bool = False  # nothing to do: the run was at train.total_steps when started
    stop_latency_s: float = 0.0  # from the signal to the saved checkpoint


def train(cfg: DAPOConfig, stop: StopRequest | None = None, engines=None) -> TrainResult:
    """Runs (or resumes) DAPO training. SIGTERM, SIGUSR1 and Ctrl-C stop it after the current
    step with a checkpoint (preemption.py); ``stop``: handlers installed by the caller, else here.
    ``engines``: rollout.placement=separate, the remote engines (rollout/separate.py ``RemoteEngines``) of
    this trainer rank, told to stop however the run ends; the engine ranks never come here (cli.py)."""
    own = stop is None
    stop = StopRequest().install() if own else stop
    run = None
    try:
        # From here on only the config as set-up resolved it (the demo's data files and base
        # filled in): what runs, and what config.yaml and W&B record.
        prep = prepare_run(cfg, engines=engines)
        cfg = prep.cfg
        if prep.resume is not None and finished(cfg.train, prep.resume.step, prep.resume.responses_generated):
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
    start = run.resume.step if run.resume else 0
    # Records are numbered by completed steps; a checkpoint at step N already holds step N's
    # record, so a resume drops only what came after it (a fresh run drops everything).
    log = MetricsLogger(run.dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                        wandb_project=cfg.logging.wandb_project, config=to_dict(cfg), enabled=run.rank == 0,
                        start_step=start + 1 if start else 0)
    clock = StepClock()
    clock.load_state_dict(run.resume.clock if run.resume else {})
    end_time = job_end_time(scontrol=run.rank == 0)  # rank 0 asks SLURM; the stop all-reduce tells the rest
    obs = Observer(cfg, run.dir, rank=run.rank, start=start, num_replicas=run.placement.num_replicas,
                   resume=run.resume, log=log)
    try:
        with StepProfiler(cfg.profile, run.dir, run.rank) as prof:  # profile.steps: a trace of those steps
            progress = StepProgress(cfg.train.total_steps, cfg.logging.progress_every_s,
                                    enabled=run.rank == 0 and cfg.logging.progress)
            run.placement.report_progress(progress if progress.enabled else None)
            loop = Loop(run, log, obs, StepBatches(run, obs, progress), StepSchedule(cfg, stop, clock, end_time, prof),
                        progress)
            # From the first step on, a signal whose grace cannot hold the step in flight cuts its
            # generation short, or abandons it past that (preemption.py).
            stop.watch(Watch(seconds_to_finish=clock.seconds_to_finish,
                             last_checkpoint=lambda: str(_latest(run) or "none yet"),
                             on_abandon=lambda line: _on_abandon(run, line), grace_s=cfg.checkpoint.stop_grace_s,
                             end_time=end_time, cut_short=loop.cut_short, seconds_to_save=loop.seconds_to_save))
            return loop.train(start)
    finally:
        log.close()
        run.actor.onload_after_rollout()  # the run's last evaluation may have left the state off


class Loop:
    """The steps of one invocation (docs/DESIGN.md "One step"): ``batches`` owns which rollouts a
    step trains on, ``schedule`` when it evaluates, saves and stops, ``saves`` when a save is written
    and published; ``run`` holds the actor and the rollout placement, ``obs`` what is seen of the
    policy, ``log`` the records, ``progress`` how far the step in flight is."""

    def __init__(self, run: Run, log: MetricsLogger, obs: Observer, batches: StepBatches, schedule: StepSchedule,
                 progress: StepProgress):
        self.run, self.log, self.obs, self.batches, self.schedule = run, log, obs, batches, schedule
        self.progress = progress  # inside a step (batches reports the rollout's)
        self.final: dict[str, float] = {}  # the newest evaluation's metrics
        self.done = 0  # completed steps
        self.saves = StepSaves(run.actor, str(run.ckpt_dir), schedule.clock, background=run.cfg.checkpoint.async_save,
                               saved=0)
        # A stop's watchdog may cut the step short while it generates (cut_short, from its thread):
        # the state as of the step's start, kept while it is not saved, is what the stop then saves
        # (with the batches asked for ahead collected: StepBatches.cut_state).
        self._phase = threading.Lock()
        self._generating = False
        self._start_state: TrainerState | None = None

    def train(self, start: int) -> TrainResult:
        run, batches, schedule = self.run, self.batches, self.schedule
        cfg, actor, placement = run.cfg, run.actor, run.placement
        self._begin(start)
        self.done = self.saves.saved = start
        ends = False  # at train.total_steps, or the generation budget spent
        for step in range(start, cfg.train.total_steps):
            if not schedule.begin(step):
                break
            step_start, metrics, progress = time.perf_counter(), {}, self.progress
            progress.begin_step(step + 1)
            self.saves.poll()  # a checkpoint written in the background since: published
            if cfg.actor.offload_during_rollout:
                with self.log.timer("offload"):  # the engine generates in the trainer's grads' and optimizer's memory
                    metrics.update(actor.offload_for_rollout())
            try:
                with self._generating_phase(), self.log.timer("rollout"):
                    self._start_state = self._start() if placement.aborts and self.done > self.saved else None
                    batch = batches.collect(step)
            except GenerationAborted:  # a stop cut the step short (every rank leaves it here)
                return self._end_cut(step + 1)
            metrics.update(device_used("generating"))
            placement.sleep()  # the engine's memory goes to the trainer until the next sync
            if cfg.actor.offload_during_rollout:
                with self.log.timer("onload"):  # after the sleep: the engine's memory is free for the state again
                    actor.onload_after_rollout()
            ends = schedule.finished(step + 1, batch.generated)
            # nothing is asked for ahead when the run ends, or the job's end stops it after the next
            # step (rank 0's answer is every rank's)
            last = ends or bool(cfg.rollout.max_staleness and placement.gather([schedule.job_ends_after_next(step)])[0])
            batches.ask_ahead(step, finished=ends, last=last)
            metrics.update(batch.metrics)
            samples = to_samples(batch.groups, cfg.algorithm, cfg.reward)
            progress.phase("old log-probs", f"{len(samples)} responses")
            samples, mismatch_in_update = old_log_probs(run, self.log, samples, metrics, batch.groups, step)
            with self.log.timer("train"):
                metrics.update(update(run, samples, mismatch_in_update, progress))
            metrics.update(device_used("training"))
            written = self._write_if_due(step + 1, ends)  # (the pending checkpoint, its blocking seconds)
            # the engines take the new weights after what is in flight (timing_s/trainer_waited); at a
            # stop, only as long as the rest of the step and the save still end before the kill
            batches.await_in_flight(schedule.stop, reserve_s=schedule.wait_reserve_s())
            progress.phase("syncing weights", last_s=schedule.clock.sync)
            with self.log.timer("weight_sync"):
                _sync(run, step + 1, schedule.clock)
            eval_s = self._evaluate_if_due(metrics, schedule.step_evaluates or ends)
            metrics.update(placement.take_waits())
            metrics["timing_s/step"] = time.perf_counter() - step_start
            metrics.update(self.obs.end_step(step + 1, metrics, batch.groups, [s.advantages for s in samples]))
            # Log before saving: a crash between the two resumes from the previous checkpoint and
            # rewrites this step's record, never leaves a step without one.
            progress.end_step()
            self._log(step + 1, metrics)
            self.done = step + 1
            schedule.end(self.done, eval_s)
            if written is not None:
                self.saves.written(*written, self._state(self.done))
            if ends:
                break
        return self._end(ends)

    def _start(self) -> TrainerState:
        """What a cut (``cut_short``) saves: the state before this step draws its prompts
        (StepBatches.start_state; ``_end_cut`` completes it with the batches asked for ahead)."""
        return self.batches.start_state(self.done, clock=self.schedule.clock.state_dict(),
                                        ledger=self.obs.ledger.state(), alarms=tuple(self.obs.alarms.state()),
                                        alarm_streaks=self.obs.alarms.streaks())

    def cut_short(self) -> bool:
        """Called by a stop's watchdog (preemption.py, its own thread): aborts the step's generation
        if the step is generating (nothing trained yet); returns whether it did."""
        with self._phase:
            return self._generating and self.run.placement.abort()

    def seconds_to_save(self) -> float:
        """What a cut step's stop then needs: leaving the generation (the engines stop at their next
        token) and saving the state as of its start when it is not saved (StepClock.save_reserve,
        as in a stop's wait for the engines)."""
        return CUT_EXIT_S + (self.schedule.clock.save_reserve() if self.done > self.saved else 0.0)

    @property
    def saved(self) -> int:
        """The step the newest published checkpoint holds (a background write counts once published)."""
        return self.saves.saved

    @contextmanager
    def _generating_phase(self):
        """The step's rollout, the part of a step that a stop can cut short (``cut_short``)."""
        with self._phase:
            self._generating = True
            self.run.placement.arm_abort()
        try:
            yield
        finally:
            with self._phase:
                self._generating = False
                self.run.placement.clear_abort()  # an abort after the last batch ended: the step goes on

    def _begin(self, start: int) -> None:
        """Before the first step: the ranks' nodes and the config recorded, the engines given the
        checkpoint's weights (vLLM's start from dummy ones), the evaluation before training."""
        run, cfg = self.run, self.run.cfg
        _record_ranks(run)
        if run.rank == 0:
            (run.dir / "config.yaml").write_text(dump_yaml(cfg) + comments(list(run.derived)))
        _sync(run, start, self.schedule.clock)
        if cfg.eval.before_train and start == 0:
            run.actor.offload_for_rollout()  # the engine generates: the state goes off as for a step's rollouts
            eval_start = time.monotonic()
            metrics = _evaluate(run, self.obs)
            self.schedule.clock.record_eval(time.monotonic() - eval_start)  # the time limit's first estimate
            self._log(0, metrics | self.obs.end_step(0, metrics, [], []))

    def _end(self, ends: bool) -> TrainResult:
        """After the last step of this invocation: at a stop, the steps since the last save saved
        with what is in flight, and the watchdog stood down."""
        stop, run, done = self.schedule.stop, self.run, self.done
        self.saves.flush()  # a background write published before the run ends
        if stop.signum is None or ends:
            return TrainResult(final_eval=self.final, step=done)
        if done > self.saved:
            run.actor.onload_after_rollout()  # an evaluation may have left the state off
            self.batches.collect_in_flight()  # kept with the checkpoint
            self.saves.save_now(done, self._state(done))
        return self._stopped()

    def _end_cut(self, step: int) -> TrainResult:
        """A stop cut step ``step`` (from 1) short in its generation: nothing of it is kept; the
        steps before it are saved as they were at its start, when the last checkpoint is older."""
        stop, run = self.schedule.stop, self.run
        stop.agreed()  # a rank without a signal learns of the stop (every rank is here)
        self.saves.flush()  # a background write published first: it may be the step before this one
        if run.rank == 0:
            print(f"megatron-dapo: {stop.name}: step {step} cut short in its generation; "
                  + (f"saving steps {self.saved + 1}-{self.done}" if self.done > self.saved else "nothing to save"),
                  file=sys.stderr, flush=True)
        if self.done > self.saved:
            run.placement.sleep()  # the engine's memory back to the trainer's state for the save
            run.actor.onload_after_rollout()
            self.saves.save_now(self.done, self.batches.cut_state(self._start_state))
        return dataclasses.replace(self._stopped(), cut=step)

    def _stopped(self) -> TrainResult:
        stop = self.schedule.stop
        stop.saved()  # the last step is saved: the watchdog stands down
        latest = _latest(self.run)
        return TrainResult(final_eval=self.final, step=self.done, stopped_by=stop.name,
                           checkpoint=latest and str(latest), stop_latency_s=stop.seconds_since())

    def _evaluate_if_due(self, metrics: dict, due: bool) -> float:
        """The held-out evaluation when ``due`` (into ``metrics``); returns its seconds (0: none)."""
        if not due:
            return 0.0
        eval_start = time.monotonic()
        self.progress.phase("evaluating", last_s=self.schedule.clock.eval)
        with self.log.timer("eval"):
            self.run.actor.offload_for_rollout()  # off until the next old log-probs (publish reads no state)
            metrics.update(_evaluate(self.run, self.obs))
        return time.monotonic() - eval_start

    def _write_if_due(self, steps: int, ends: bool):
        """(the pending checkpoint after ``steps`` steps, the seconds its write blocked training) or
        None when no save is due: a save's tensors are written after the updates, while the engine
        sleeps and the state is on the device, and published after the step is logged (StepSaves)."""
        if not self.schedule.saves(steps, ends):
            return None
        self.progress.phase("writing the checkpoint", last_s=self.schedule.clock.save)
        with self.log.timer("checkpoint_write"):
            return self.saves.write(steps)

    def _state(self, steps: int) -> TrainerState:
        """The trainer state after ``steps`` steps, as of now."""
        return self.batches.state(step=steps, clock=self.schedule.clock.state_dict(), ledger=self.obs.ledger.state(),
                                  alarms=tuple(self.obs.alarms.state()), alarm_streaks=self.obs.alarms.streaks())

    def _log(self, step: int, metrics: dict) -> None:
        log, cfg = self.log, self.run.cfg
        values = log.log(step, metrics)
        if log.enabled and cfg.logging.progress:
            print(format_progress(step, values, total_steps=cfg.train.total_steps, keys=progress_keys(cfg.eval.n)),
                  flush=True)
        self.final = {k: v for k, v in values.items() if k.startswith("eval/")} or self.final


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


def evaluate_run(cfg: DAPOConfig, step: int | None = None) -> dict[str, float]:
    """``megatron-dapo eval``: the run's checkpoint of ``step`` (default: its latest, else its starting
    weights) on data.val_files, with the eval settings; writes <logging.dir>/eval.json on rank 0.
    Reads no training data, and a live run: it does not take the run directory's lock."""
    run = build_run(prepare_run(cfg, eval_only=EvalOnly(step)))
    try:
        _sync(run)
        result = {"step": run.resume.step if run.resume else 0, **_evaluate(run)}
    finally:
        run.close()
    if run.rank == 0:
        run.dir.mkdir(parents=True, exist_ok=True)  # evaluating an HF dir: a fresh logging.dir
        (run.dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"evaluation of step {result['step']}: " + _fmt({k: v for k, v in result.items() if k != "step"}),
              flush=True)
    return result


def setup_logging() -> None:
    """Our INFO lines from rank 0 only, warnings and errors from every rank: the same news from every
    rank is noise, one rank's trouble is not (an engine rank logs its own events: cli._serve_or_join).
    The other ranks' transformers progress bars (each rank loading its engine's weights) go too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-parameter and config dumps
    if ranks.rank() != 0:
        from transformers.utils import logging as hf_logging

        logging.getLogger("megatron_dapo").setLevel(logging.WARNING)
        hf_logging.disable_progress_bar()


def main(cfg: DAPOConfig, stop: StopRequest | None = None, engines=None) -> int:
    """``megatron-dapo train`` on a trainer rank (cli.py; ``engines`` as for ``train``): the run, then
    on rank 0 its plots, report page and last line."""
    from megatron_dapo.observe.report import write_report
    from megatron_dapo.plotting import plot_run

    setup_logging()
    result = train(cfg, stop, engines)
    if ranks.rank() != 0:  # a finished run never starts torch.distributed
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
        cut = f", step {result.cut} cut short in its generation" if result.cut else ""
        print(f"megatron-dapo: stopped by {result.stopped_by} after step {result.step} of "
              f"{cfg.train.total_steps}{cut} ({result.stop_latency_s:.1f} s after the signal): {saved}; rerun the "
              "same command to resume", flush=True)
    else:
        print("final evaluation: " + _fmt(result.final_eval), flush=True)
    return 0


def _fmt(values: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(values.items()))
