"""The loop's one handle on observability: sample dumps, alarms and the pass-rate ledger, per step.

train.py calls, in order, for each step: ``draw`` (prompts, with the ledger's curation) and
``row_spec`` per generation batch, ``add_batch`` with what it returned, ``add_eval`` after an
evaluation, then ``end_step`` with the trained groups and their advantages, which returns the
step's extra metrics (alarm/*, ledger/*) and writes the step's dumps. Every rank runs the same
calls (the ledger and the alarms decide the same on each); only rank 0 writes files.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_dapo.config import AlarmsConfig, EvalConfig, RewardConfig
from megatron_dapo.metrics_log import to_floats, truncate_from_step
from megatron_dapo.observe import audit
from megatron_dapo.observe.alarms import ALARMS_FILE, AlarmMonitor
from megatron_dapo.observe.ledger import PassRateLedger
from megatron_dapo.observe.rows import RowSpec, SampleRow, alarm_file, drop_from_step, step_file, write_rows
from megatron_dapo.reward import VALUE_REWARD_FN

logger = logging.getLogger("megatron_dapo.observe")


def audit_fn_name(alarms: AlarmsConfig, eval: EvalConfig, reward: RewardConfig) -> str | None:
    """alarms.audit_fn resolved: ``auto`` = eval.reward_fn, or dapo_math when that is reward.fn."""
    name = alarms.audit_fn
    if name == "none" or not alarms.enable:
        return None
    if name == "auto":
        name = eval.reward_fn if eval.reward_fn != reward.fn else VALUE_REWARD_FN
    return None if name == reward.fn else name


@dataclass
class _Step:
    """What one step has collected so far."""

    rows: list[SampleRow] = field(default_factory=list)
    flagged: list[SampleRow] = field(default_factory=list)
    eval_rows: list[SampleRow] = field(default_factory=list)
    audits: list = field(default_factory=list)
    skipped: int = 0
    groups: int = 0  # groups generated this step so far


class Observer:
    def __init__(self, cfg, run_dir: Path, *, rank: int, start: int, num_replicas: int, resume=None, log=None):
        self.cfg, self.dir, self.writes = cfg, Path(run_dir), rank == 0
        self.log = log  # MetricsLogger: the dumps also go to TensorBoard and W&B
        self.ledger = PassRateLedger(cfg.data.skip_solved_after)
        self.alarms = AlarmMonitor(cfg.alarms, run_dir, enabled_writes=self.writes)
        if resume is not None:
            self.ledger.restore(resume.ledger)
            self.alarms.restore(list(resume.alarms), resume.alarm_streaks)
        if self.writes:  # the steps after the checkpoint run again: their files go, as metrics.jsonl's records
            first = start + 1 if start else 0
            drop_from_step(self.dir, first)
            truncate_from_step(self.dir / ALARMS_FILE, first)
        self.audit_fn = audit_fn_name(cfg.alarms, cfg.eval, cfg.reward)
        lg, n = cfg.logging, cfg.rollout.n
        self._dump_groups = math.ceil(lg.samples_per_step / n) if lg.samples_every else 0
        self._flag_cap = math.ceil(cfg.alarms.max_samples / max(1, num_replicas)) if cfg.alarms.enable else 0
        self._step = _Step()

    def draw(self, sampler, k: int) -> list[int]:
        indices, skipped = self.ledger.draw(sampler, k)
        self._step.skipped += skipped
        return indices

    def row_spec(self, num_gen_batch: int) -> RowSpec:
        """Rows of the step's first generation batch only (whole groups, up to samples_per_step)."""
        return RowSpec(phase="train", dump_groups=self._dump_groups if num_gen_batch == 0 else 0,
                       flag_cap=self._flag_cap, max_chars=self.cfg.logging.samples_max_chars,
                       scorer=self.cfg.reward.fn, audit_scorer=self.audit_fn)

    def eval_spec(self) -> RowSpec:
        lg, ev = self.cfg.logging, self.cfg.eval
        return RowSpec(phase="eval", dump_groups=math.ceil(lg.samples_per_step / ev.n) if lg.samples_every else 0,
                       flag_cap=0, max_chars=lg.samples_max_chars, scorer=ev.reward_fn, audit_scorer=VALUE_REWARD_FN)

    def add_batch(self, batch, indices: list[int]) -> None:
        """A generation batch's GenBatch (groups.py): rows numbered within the step (after the
        groups of its earlier batches, whatever their sizes), ledger updated."""
        offset = self._step.groups
        self._step.rows += [replace(r, group=r.group + offset) for r in batch.rows]
        self._step.flagged += [replace(r, group=r.group + offset) for r in batch.flagged]
        self._step.audits += batch.audits
        self._step.groups += len(indices)
        self.ledger.record(indices, batch.acc.tolist())

    def add_eval(self, rows: list[SampleRow]) -> None:
        self._step.eval_rows += rows

    def end_step(self, record_step: int, metrics: dict, trained_groups: list, advantages: list[float]) -> dict:
        """The step's alarm/* and ledger/* metrics; the dumps written (rank 0). ``record_step``: the
        metrics record's step (0: the evaluation before training); ``advantages``: per response of
        ``trained_groups``, in order."""
        st, self._step = self._step, _Step()
        out: dict[str, float] = {}
        if self.cfg.alarms.enable and st.audits:
            out |= audit.audit_metrics(st.audits)
        if record_step:
            out |= self.ledger.metrics() | {"ledger/skipped_prompts": float(st.skipped)}
        # Each row keeps the weight version its rollout was generated with (the placement stamps it):
        # a batch asked for ahead (rollout.max_staleness) is older than the step's trainer.
        rows, flagged = (_with_advantages(x, trained_groups, advantages, self.cfg.rollout.n)
                         for x in (st.rows, st.flagged))
        rows, flagged, eval_rows = ([replace(r, step=record_step) for r in x] for x in (rows, flagged, st.eval_rows))
        events, raised = self.alarms.check(record_step, to_floats(metrics) | out)
        out["alarm/num_raised"] = float(len(raised))
        if self.writes:
            self._write(record_step, rows, eval_rows, flagged, raised, {e.alarm for e in events})
        return out

    def _write(self, step, rows, eval_rows, flagged, raised, new) -> None:
        every = self.cfg.logging.samples_every
        regular = (rows if every and step and step % every == 0 else []) + eval_rows
        if regular:
            write_rows(step_file(self.dir, step), regular)
            if self.log is not None:
                for phase in ("train", "eval"):
                    self.log.log_samples(step, phase, [r.to_json() for r in regular if r.phase == phase])
        if self.log is not None and step:
            self.log.log_histogram(step, "ledger/pass_rate", self.ledger.pass_rates())
        cap = self.cfg.alarms.max_samples
        for rule in raised:
            if rule.flag is not None:
                pool = flagged + [r for r in rows + eval_rows if r not in flagged]
                picked = [r for r in pool if rule.flag in r.flags][:cap]
            elif rule.name in new:  # a step-level alarm: the step's samples, once
                picked = ([r for r in eval_rows if audit.DISAGREE in r.flags] if rule.name.startswith("eval_")
                          else rows)[:cap]
            else:
                picked = []
            if picked:
                write_rows(alarm_file(self.dir, step, rule.name), picked)


def _with_advantages(rows: list[SampleRow], groups: list, advantages: list[float], n: int) -> list[SampleRow]:
    """Rows of trained groups get their response's advantage (matched by prompt and response)."""
    by_prompt = {g.prompt_index: advantages[i * n:(i + 1) * n] for i, g in enumerate(groups)}
    out = []
    for r in rows:
        adv = by_prompt.get(r.prompt_index) if r.kept else None
        out.append(replace(r, advantage=adv[r.response_index]) if adv else r)
    return out
