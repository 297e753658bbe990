"""Which rollouts a step trains on: the one owner of a step's generation batches.

A step's batch is filled by dynamic sampling (algo/dynamic_sampling.py) from generation batches,
each drawn in its step or asked for ahead at bounded staleness (rollout/pipeline.py), and with
partial rollouts each continuing the responses cut in the batches before it (gen_batches.py,
rollout/partial.py). Responses generated, kept or not, count against train.generation_budget. The
loop asks this object for a step's batch (``collect``), tells it when the step's rollout is over
(``ask_ahead``: what to generate while the step trains) and, before a sync or a stop's save, waits
for or keeps what is in flight. What a checkpoint keeps of all this comes from ``state`` and goes
back in through the constructor: one place each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dapo.algo import DynamicSampler
from megatron_dapo.gen_batches import GenerationBatches
from megatron_dapo.groups import Group, rollout_metrics, version_lag
from megatron_dapo.observe.step_progress import StepProgress
from megatron_dapo.preemption import StopRequest
from megatron_dapo.rollout.partial import partial_metrics
from megatron_dapo.rollout.pipeline import GenRequest, RolloutPipeline
from megatron_dapo.trainer_state import TrainerState


@dataclass(frozen=True)
class StepBatch:
    """One step's rollouts: the kept prompt groups (data.prompts_per_step of them) and how they were
    drawn (dynamic_sampling/*, rollout/* partial and version-lag metrics, the responses generated)."""

    groups: list[Group]
    metrics: dict[str, float]
    generated: int  # every response generated so far in the run, kept or not


class StepBatches:
    """A run's generation batches, step by step (module doc).

    Args:
        run: the built run (its config, sampler, placement; its resume point, if any, is restored).
        obs: the run's Observer (prompt draws, dump rows).
        progress: told of each generation batch (observe/step_progress.py; None: nobody).
    """

    def __init__(self, run, obs, progress: StepProgress | None = None):
        cfg, fg = run.cfg, run.cfg.algorithm.filter_groups
        self.cfg, self.run, self.obs = cfg, run, obs
        self.progress = progress or StepProgress(cfg.train.total_steps, 0.0, enabled=False)
        self.dyn = DynamicSampler(prompts_per_step=cfg.data.prompts_per_step, group_size=cfg.rollout.n,
                                  max_num_gen_batches=fg.max_num_gen_batches, enabled=fg.enable,
                                  surplus=cfg.surplus, adaptive=fg.adaptive, max_request=fg.max_gen_prompts,
                                  on_exhausted=fg.on_exhausted)
        # Without dynamic sampling every group is kept: a generation batch is the step's prompts.
        self.gen_batch = cfg.data.gen_prompts_per_batch if self.dyn.enabled else cfg.data.prompts_per_step
        self.pipeline = RolloutPipeline(cfg.rollout.max_staleness, cfg.train.total_steps, cfg.checkpoint.save_every)
        resume = run.resume
        if resume:
            run.sampler.load_state_dict(resume.sampler)
            self.dyn.restore_held(resume.held_groups, resume.keep_rate)
            self.pipeline.restore(list(resume.ahead))
        self.gen = GenerationBatches(run, obs, resume.carried if resume else ())
        self.generated = resume.responses_generated if resume else 0
        self._first: GenRequest | None = None  # the step's first batch, asked for ahead (start_state)

    def collect(self, step: int) -> StepBatch:
        """Step ``step``'s batch (from 0): generation batches until dynamic sampling holds the step's
        groups, the batch asked for in an earlier step taken even when groups carried over
        (surplus=carry) already fill it."""
        dyn, pipeline, gen = self.dyn, self.pipeline, self.gen
        dyn.start_step()
        while not dyn.is_full or pipeline.has(step):
            self._report(dyn)
            ahead = pipeline.take(step)
            if ahead is None:
                ahead = gen.draw(step, dyn.num_gen_batches, dyn.request_size(self.gen_batch))
            batch, indices = gen.scored_groups(ahead, keep=dyn.keep_mask, rows=self.obs.row_spec(dyn.num_gen_batches),
                                          carry_all=dyn.carries_all())
            self.obs.add_batch(batch, indices)
            dyn.add(batch.groups, batch.acc)
        groups, metrics = dyn.pop()
        if self.cfg.rollout.partial:  # the carry before a batch asked for ahead takes it
            if self.cfg.rollout.partial_unfinished == "abort":  # the groups still growing are dropped
                metrics["rollout/aborted_tokens"] = float(gen.abort_carry())
            metrics.update(partial_metrics(groups, gen.carry, step))
        self.generated += int(metrics["dynamic_sampling/num_groups_generated"]) * self.cfg.rollout.n
        metrics.update(rollout_metrics(groups) | version_lag(groups, step))
        metrics["rollout/responses_generated_total"] = self.generated
        return StepBatch(groups, metrics, self.generated)

    def _report(self, dyn: DynamicSampler) -> None:
        """The generation batch about to be generated or collected, for the step's progress."""
        most = f" of at most {dyn.max_num_gen_batches}" if dyn.enabled and dyn.max_num_gen_batches else ""
        kept = f"; {len(dyn.held)}/{dyn.prompts_per_step} groups kept" if dyn.enabled else ""
        self.progress.phase("generating", f"batch {dyn.num_gen_batches + 1}{most}{kept}")

    def ask_ahead(self, step: int, *, finished: bool, last: bool) -> None:
        """The end of step ``step``'s rollout: what the engines generate while it trains. ``finished``:
        the run ends with this step (what is in flight is cancelled); ``last``: nothing is asked for
        ahead (the run's end, or the job's end stops it after the next step)."""
        pipeline, gen = self.pipeline, self.gen
        if finished:
            pipeline.drop(gen.cancel)  # a generation budget spent: batches asked for ahead will not be trained on
        for ahead in [] if last else pipeline.released(step):
            gen.submit(ahead)  # a stop released them: asked for again, in order (else in their steps)
        for target in pipeline.targets(step, finished=last):  # generated while this step trains
            # no new prompts when the groups carried over (surplus=carry) fill every step up to it
            ahead = gen.draw(target, 0, self.dyn.ahead_request_size(self.gen_batch, target - step))
            if ahead.indices or ahead.carried:
                gen.submit(ahead)
                pipeline.add(ahead)

    def await_in_flight(self, stop: StopRequest, *, reserve_s: float) -> None:
        """Before a sync: the batches in flight finish first (gen_batches.GenerationBatches.await_in_flight)."""
        self.gen.await_in_flight(self.pipeline, stop, reserve_s=reserve_s)

    def collect_in_flight(self) -> None:
        """At a stop, before its save: the batches in flight, kept with the checkpoint."""
        self.gen.collect_in_flight(self.pipeline)

    def start_state(self, step: int, **others) -> TrainerState:
        """The state before step ``step`` (from 0) draws its prompts, which a stop that cuts the step
        short saves (train.Loop; ``others`` as for ``state``). The step's first batch, asked for
        ahead, is collected now: the last sync waited for it (rollout/pipeline.py) and the step
        collects it first anyway. The batches asked for ahead are ``cut_state``'s to add."""
        first = self.pipeline.ahead[0] if self.pipeline.has(step) else None
        if first is not None and first.in_flight:
            first.rollouts = self.run.placement.collect(first.request)[1]
        self._first = first
        return self.state(step=step, with_ahead=False, **others)

    def cut_state(self, start: TrainerState) -> TrainerState:
        """``start`` (``start_state``), the step cut short: the batches asked for ahead of later
        steps collected (finished before the last sync; the cut aborted only the step's own), so the
        resumed run trains on the very batches the uninterrupted one would have."""
        self.collect_in_flight()
        ahead = ([self._first.to_json()] if self._first is not None else []) + self.pipeline.to_json()
        return dataclasses.replace(start, ahead=tuple(ahead))

    def state(self, *, step: int, clock: dict, ledger: dict, alarms: tuple[str, ...], alarm_streaks: dict,
              with_ahead: bool = True) -> TrainerState:
        """The trainer state after ``step`` steps: this object's part, and the others' as given.
        ``with_ahead=False``: without the batches asked for ahead (``start_state``: ``cut_state`` adds them)."""
        return TrainerState(step=step, sampler=self.run.sampler.state_dict(), held_groups=self.dyn.held,
                            responses_generated=self.generated, clock=clock, ledger=ledger,
                            keep_rate=self.dyn.keep_rate, alarms=alarms, alarm_streaks=alarm_streaks,
                            ahead=tuple(self.pipeline.to_json()) if with_ahead else (),
                            carried=tuple(self.gen.carry_json()))
