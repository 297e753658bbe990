"""Sample dumps: what the policy wrote, one JSON row per response, under ``<logging.dir>/samples/``.

Files (rank 0 writes them; each is written whole to a temporary name and renamed, so a crash never
leaves half a file):
- ``step_NNNNNNNN.jsonl``: every ``logging.samples_every`` steps, the first prompt groups of the
  step's first generation batch, kept by dynamic sampling or not, up to ``logging.samples_per_step``
  responses (whole groups); on an evaluation step also as many held-out responses (phase "eval").
  Step N is the metrics record N: the rollouts of step N were generated before its update.
- ``alarm_NNNNNNNN_<alarm>.jsonl``: at a step where an alarm is raised, up to ``alarms.max_samples``
  of the responses that raised it (observe/alarms.py).

A resumed run deletes the files of the steps it will run again (as metrics.jsonl drops their records)
and never touches the others. docs/observability.md has the reader's guide and the measured cost.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES_DIR = "samples"
_STEP_FILE = re.compile(r"^(?:step|alarm)_(\d{8})(?:_[a-z_]+)?\.jsonl$")


@dataclass
class SampleRow:
    """One response as a dump holds it. Texts are decoded; a response longer than
    ``logging.samples_max_chars`` is cut in its middle (``response_chars`` is its full length)."""

    phase: str  # "train" or "eval"
    prompt_index: int  # row of the training (or evaluation) prompt set
    group: int  # position of the group in its step (generation batch x batch size + position)
    response_index: int  # 0..G-1 within the group
    prompt: str
    response: str
    response_tokens: int
    response_chars: int
    finish_reason: str  # "stop" or "length" (truncated)
    ground_truth: str
    scorer: str
    acc: bool  # the scorer's verdict (reward.fn in training, eval.reward_fn in evaluation)
    pred: str  # the answer it extracted
    audit_scorer: str | None = None  # the second scorer (alarms.audit_fn; dapo_math in evaluation)
    audit_acc: bool | None = None
    audit_pred: str | None = None
    score: float | None = None  # +-1 correctness (training)
    reward: float | None = None  # score + overlong penalty: what the advantage sees
    advantage: float | None = None  # None: not trained on (a dropped group, or evaluation)
    kept: bool | None = None  # dynamic sampling kept the group (training)
    weight_version: int = 0  # updates (steps) the generating weights had seen
    pieces: list[list[int]] = field(default_factory=list)  # rollout.partial: [version, tokens] of each piece
    step: int = 0  # the metrics record this row belongs to
    flags: list[str] = field(default_factory=list)  # observe/audit.py flags

    def to_json(self) -> dict:
        # Flat fields: a shallow copy equals dataclasses.asdict, whose recursive deep copy was most
        # of the dump's cost (64 rows a step).
        return {name: list(v) if isinstance(v := getattr(self, name), list) else v for name in _FIELDS}

    @classmethod
    def from_json(cls, data: dict) -> "SampleRow":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


_FIELDS = tuple(f.name for f in dataclasses.fields(SampleRow))


def clip_text(text: str, max_chars: int) -> str:
    """``text`` whole when it fits, else its head and its tail (where the answer line is) around
    a marker naming how many characters were cut."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 4
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters cut ...]\n{text[-tail:]}"


def step_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"step_{step:08d}.jsonl"


def alarm_file(run_dir: Path, step: int, alarm: str) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"alarm_{step:08d}_{alarm}.jsonl"


def file_step(path: Path) -> int | None:
    """The step of a dump file's name, or None for any other file."""
    match = _STEP_FILE.match(path.name)
    return int(match.group(1)) if match else None


def write_rows(path: Path, rows: list[SampleRow]) -> int:
    """Writes ``rows`` to ``path`` (tmp + rename); returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def read_rows(path: Path) -> list[SampleRow]:
    """The rows of one dump file (a line that does not parse is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(SampleRow.from_json(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return rows


def dump_files(run_dir: Path) -> list[Path]:
    """Every dump file of a run, by step then name."""
    folder = Path(run_dir) / SAMPLES_DIR
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if file_step(p) is not None]
    return sorted(files, key=lambda p: (file_step(p), p.name))


def drop_from_step(run_dir: Path, start_step: int) -> int:
    """Deletes the dumps of steps >= ``start_step`` (a resumed run writes them again); returns how many."""
    gone = 0
    for path in dump_files(run_dir):
        if file_step(path) >= start_step:
            path.unlink()
            gone += 1
    for tmp in (Path(run_dir) / SAMPLES_DIR).glob("*.tmp"):
        tmp.unlink()
    return gone


@dataclass(frozen=True)
class RowSpec:
    """What a replica's leader needs to turn a scored group into dump rows (groups.py)."""

    phase: str  # "train" or "eval"
    dump_groups: int  # groups at batch positions below this become rows
    flag_cap: int  # at most this many flagged responses per flag travel from one replica's share
    max_chars: int  # logging.samples_max_chars
    scorer: str
    audit_scorer: str | None


def group_rows(spec: RowSpec, *, prompt_index: int, position: int, prompt: str, texts: list[str], rollouts,
               ground_truth: str, results: list[dict], audit_results: list[dict] | None, flags: list[list[str]],
               scores: list[float] | None = None, rewards: list[float] | None = None,
               kept: bool | None = None) -> list[SampleRow]:
    """The rows of one scored group (``rollouts``: its engine outputs, ``texts`` their decoded
    responses, ``results`` / ``audit_results`` the two scorers' dicts, ``flags`` audit.audit_group's)."""
    prompt = clip_text(prompt, spec.max_chars)
    rows = []
    for j, (text, r, res) in enumerate(zip(texts, rollouts, results)):
        audit = audit_results[j] if audit_results is not None else None
        rows.append(SampleRow(
            phase=spec.phase, prompt_index=prompt_index, group=position, response_index=j, prompt=prompt,
            response=clip_text(text, spec.max_chars), response_tokens=len(r.response_ids), response_chars=len(text),
            finish_reason=r.finish_reason, ground_truth=ground_truth, scorer=spec.scorer, acc=bool(res["acc"]),
            pred=str(res.get("pred", "")), audit_scorer=spec.audit_scorer if audit else None,
            audit_acc=bool(audit["acc"]) if audit else None, audit_pred=str(audit.get("pred", "")) if audit else None,
            score=scores[j] if scores else None, reward=rewards[j] if rewards else None, kept=kept,
            flags=list(flags[j]), weight_version=r.weight_version,
            pieces=[list(p) for p in r.pieces]))
    return rows


def pick_flagged(rows: list[SampleRow], counts: dict[str, int], cap: int) -> list[SampleRow]:
    """The rows with a flag whose count (``counts``, updated) is still below ``cap``."""
    out = []
    for row in rows:
        take = False
        for flag in row.flags:
            if counts.get(flag, 0) < cap:
                counts[flag] = counts.get(flag, 0) + 1
                take = True
        if take:
            out.append(row)
    return out
