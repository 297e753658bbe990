"""Format checks of response texts: what the alarms count (pure Python, no torch).

Two degenerate formats were once learned by the tiny policy and accepted by a scorer: a repeated
label (``Answer: Answer: 5``, ``AnswerAnswerAnswer: 3``) and, in collapse, every response of a group
the same text. Each counts only where it means trouble, so that a healthy run raises no alarm:

- a repeated label only where the reward pays for it (acc): one it rejects is a sampled typo the
  update pushes away, one it accepts is a format the policy is rewarded into (reward hacking);
- a group of one repeated text only where it is wrong: one right answer given every time is what a
  solved prompt looks like (the healthy CPU demo had half its groups so at step 40), one wrong answer
  given every time is a policy that stopped exploring where it fails.

Each response gets a set of flags; a group's counts travel from the replica that scored it
(groups.py), so the alarms see every generated response, kept by dynamic sampling or not.

Only the tail of a response is read for the answer line (the scorers read at most 1000
characters), so checking costs the same at 20k-token responses as at 16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_CHARS = 1000
_LABEL = re.compile(r"(?i)answer")
_ANSWER_LINE = re.compile(r"(?i)answer\s*:")

# Flag names: also the names of their alarms (observe/alarms.py) and of the alarm dumps.
REPEATED_LABEL = "repeated_answer_label"
NO_ANSWER_LINE = "no_answer_line"
IDENTICAL_GROUP = "identical_groups"
DISAGREE = "scorer_disagreement"
RESPONSE_FLAGS = (REPEATED_LABEL, NO_ANSWER_LINE, IDENTICAL_GROUP, DISAGREE)


def answer_line(text: str) -> str | None:
    """The last line of ``text``'s tail holding an ``Answer:`` label, or None."""
    lines = [line for line in text[-TAIL_CHARS:].splitlines() if _ANSWER_LINE.search(line)]
    return lines[-1] if lines else None


def format_flags(text: str, rewarded: bool) -> list[str]:
    """The flags of one response text by itself: no answer line, or one that repeats the label and
    that the reward accepts (``rewarded``: the reward's acc; module doc)."""
    line = answer_line(text)
    if line is None:
        return [NO_ANSWER_LINE]
    return [REPEATED_LABEL] if rewarded and len(_LABEL.findall(line)) > 1 else []


@dataclass(frozen=True)
class GroupAudit:
    """Counts of one prompt group (G responses): what the step's alarm metrics sum."""

    num_responses: int
    repeated_label: int
    no_answer_line: int
    identical: bool  # every response the same wrong text (G >= 2; module doc)
    disagree: int  # responses the audit scorer judges otherwise than the reward's (0 without one)

    def to_json(self) -> dict:
        return {"num_responses": self.num_responses, "repeated_label": self.repeated_label,
                "no_answer_line": self.no_answer_line, "identical": self.identical, "disagree": self.disagree}

    @classmethod
    def from_json(cls, data: dict) -> "GroupAudit":
        return cls(**data)


def audit_group(texts: list[str], acc: list[bool], audit_acc: list[bool] | None) -> tuple[GroupAudit, list[list[str]]]:
    """A group's counts and each response's flags (in order). ``audit_acc``: the second scorer's
    verdicts (None: no second scorer, no disagreement counted)."""
    flags = [format_flags(t, bool(a)) for t, a in zip(texts, acc, strict=True)]
    identical = len(texts) >= 2 and len(set(texts)) == 1 and not any(acc)
    if identical:
        flags = [f + [IDENTICAL_GROUP] for f in flags]
    disagree = 0
    if audit_acc is not None:
        for f, a, b in zip(flags, acc, audit_acc):
            if bool(a) != bool(b):
                f.append(DISAGREE)
                disagree += 1
    audit = GroupAudit(num_responses=len(texts), repeated_label=sum(REPEATED_LABEL in f for f in flags),
                       no_answer_line=sum(NO_ANSWER_LINE in f for f in flags), identical=identical,
                       disagree=disagree)
    return audit, flags


def audit_metrics(audits: list[GroupAudit], prefix: str = "alarm/") -> dict[str, float]:
    """Fractions over the audited responses (groups for identical_groups)."""
    if not audits:
        return {}
    n = sum(a.num_responses for a in audits)
    return {prefix + REPEATED_LABEL: sum(a.repeated_label for a in audits) / n,
            prefix + NO_ANSWER_LINE: sum(a.no_answer_line for a in audits) / n,
            prefix + IDENTICAL_GROUP: sum(a.identical for a in audits) / len(audits),
            prefix + DISAGREE: sum(a.disagree for a in audits) / n}
