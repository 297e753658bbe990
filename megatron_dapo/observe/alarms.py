"""Alarms: a metric every step, a one-line warning when it crosses its threshold, a dump of the cause.

Each rule watches one metric of the step's record against a threshold of ``alarms.*``. An alarm is
*raised* at the step its metric crosses the threshold (one warning line, one event in
``<logging.dir>/alarms.jsonl``) and stays raised, silently, until the metric is back on the safe
side. A rule with ``steps`` is raised only when its metric has been across for that many steps in a
row: a state that lasts (a solved data set), not one step's draw of prompts. While raised, the
responses that raise a response-level alarm (a flag of observe/audit.py) are dumped every step to
``samples/alarm_<step>_<name>.jsonl``; a step-level alarm (entropy, mismatch, saturation, shortcut
fallbacks) dumps the step's sampled responses once, when it is raised. The
raised set and the streaks are part of the trainer state, so a resumed run warns exactly where the
uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config import AlarmsConfig
from megatron_dapo.observe import audit

logger = logging.getLogger("megatron_dapo.alarms")

ALARMS_FILE = "alarms.jsonl"


@dataclass(frozen=True)
class AlarmRule:
    name: str
    metric: str  # key of the step's record
    threshold: str  # field of AlarmsConfig
    above: bool  # raised when the metric is above the threshold (else below)
    flag: str | None  # the response flag it dumps (None: a step-level alarm)
    hint: str  # where to look, in the warning line
    steps: str | None = None  # field of AlarmsConfig: steps in a row across before it is raised (None: 1)


RULES: tuple[AlarmRule, ...] = (
    AlarmRule("scorer_disagreement", "alarm/scorer_disagreement", "scorer_disagreement", True, audit.DISAGREE,
              "the two scorers judge many responses differently: a format one of them accepts (reward hacking?)"),
    AlarmRule("eval_scorer_disagreement", "eval/scorer_disagreement", "scorer_disagreement", True, None,
              "held-out responses judged differently by the two scorers"),
    AlarmRule("repeated_answer_label", "alarm/repeated_answer_label", "repeated_answer_label", True,
              audit.REPEATED_LABEL, "rewarded answer lines repeat the label (Answer: Answer: 5): the reward pays "
              "for a degenerate format"),
    AlarmRule("no_answer_line", "alarm/no_answer_line", "no_answer_line", True, audit.NO_ANSWER_LINE,
              "responses without an 'Answer:' line (truncation, or the format lost)"),
    AlarmRule("identical_groups", "alarm/identical_groups", "identical_groups", True, audit.IDENTICAL_GROUP,
              "whole groups of one repeated wrong response: collapse where the policy fails"),
    AlarmRule("entropy_collapse", "actor/entropy", "entropy_min", False, None,
              "policy entropy near zero: exploration is gone (raise loss.clip_ratio_high?)"),
    AlarmRule("mismatch_spike", "rollout/logprob_mismatch", "mismatch_max", True, None,
              "engine and trainer log-probs disagree: a weight-sync or numerics problem"),
    AlarmRule("all_correct", "dynamic_sampling/frac_all_correct", "all_correct", True, None,
              "nearly every group is all correct: the data is solved (data.skip_solved_after?)",
              steps="all_correct_steps"),
    AlarmRule("shortcut_fallbacks", "actor/grad_shortcut_fallbacks", "shortcut_fallbacks", True, None,
              "the output layer's gradient shortcut fell back to recompute (slower, still exact)"),
)


def thresholds(alarms: AlarmsConfig) -> dict[str, float]:
    """AlarmsConfig's thresholds by field name (what ``AlarmRule.threshold`` names)."""
    return {"scorer_disagreement": alarms.scorer_disagreement, "repeated_answer_label": alarms.repeated_answer_label,
            "no_answer_line": alarms.no_answer_line, "identical_groups": alarms.identical_groups,
            "entropy_min": alarms.entropy_min, "mismatch_max": alarms.mismatch_max, "all_correct": alarms.all_correct,
            "shortcut_fallbacks": alarms.shortcut_fallbacks}


def steps_in_a_row(alarms: AlarmsConfig) -> dict[str, int]:
    """AlarmsConfig's steps-in-a-row fields by name (what ``AlarmRule.steps`` names)."""
    return {"all_correct_steps": alarms.all_correct_steps}


@dataclass(frozen=True)
class AlarmEvent:
    step: int
    alarm: str
    value: float
    threshold: float
    message: str

    def to_json(self) -> dict:
        return {"step": self.step, "alarm": self.alarm, "value": self.value, "threshold": self.threshold,
                "message": self.message}


class AlarmMonitor:
    """Checks a step's metrics against the rules; remembers which alarms are raised."""

    def __init__(self, cfg: AlarmsConfig, run_dir: Path, *, enabled_writes: bool):
        self.cfg = cfg
        self.path = Path(run_dir) / ALARMS_FILE
        self.writes = enabled_writes  # rank 0
        self.raised: set[str] = set()
        self.streak: dict[str, int] = {}  # steps in a row across, for the rules with ``steps``
        self.thresholds = thresholds(cfg)
        self.steps = steps_in_a_row(cfg)

    def check(self, step: int, metrics: dict[str, float]) -> tuple[list[AlarmEvent], list[AlarmRule]]:
        """(alarms raised at this step, every rule raised now). Metrics absent from the step
        (no evaluation, no mismatch check) leave their alarm as it was."""
        if not self.cfg.enable:
            return [], []
        events = []
        for rule in RULES:
            value = metrics.get(rule.metric)
            if value is None:
                continue
            threshold = float(self.thresholds[rule.threshold])
            crossed = value > threshold if rule.above else value < threshold
            self.streak[rule.name] = self.streak.get(rule.name, 0) + 1 if crossed else 0
            lasted = self.streak[rule.name] >= (self.steps[rule.steps] if rule.steps else 1)
            if crossed and lasted and rule.name not in self.raised:
                self.raised.add(rule.name)
                side = "above" if rule.above else "below"
                during = f" for {self.streak[rule.name]} steps" if rule.steps else ""
                events.append(AlarmEvent(step, rule.name, float(value), threshold,
                                         f"alarm {rule.name} at step {step}: {rule.metric}={value:.4g} {side} "
                                         f"alarms.{rule.threshold}={threshold:g}{during}; {rule.hint}"))
            elif not crossed:
                self.raised.discard(rule.name)
        for event in events:
            logger.warning(event.message)
        if self.writes and events:
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(e.to_json()) + "\n" for e in events)
        return events, [r for r in RULES if r.name in self.raised]

    def state(self) -> list[str]:
        return sorted(self.raised)

    def streaks(self) -> dict[str, int]:
        """The streaks of the rules with ``steps`` not raised yet (those the next steps can raise)."""
        return {r.name: self.streak[r.name] for r in RULES
                if r.steps and self.streak.get(r.name) and r.name not in self.raised}

    def restore(self, raised: list[str], streaks: dict[str, int] | None = None) -> None:
        self.raised = set(raised)
        self.streak = dict(streaks or {})


def read_events(run_dir: Path) -> list[dict]:
    """The events of a run's alarms.jsonl (a broken line skipped)."""
    path = Path(run_dir) / ALARMS_FILE
    events = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events
