"""``megatron-dapo samples RUN_DIR``: the sample dumps (observe/rows.py) read in the terminal.

A metric says that accuracy fell or that the scorers disagree; the dumps say on which responses.
This reader picks one step's file (the latest by default), keeps the rows every ``--where`` term
holds for, and prints each as a header line, the prompt's tail and the response with its answer
line marked, since the answer line is what both scorers read. Pure standard library: it runs on a
laptop next to a copied run directory. docs/observability.md has the user's guide.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from pathlib import Path

from megatron_dapo.errors import InputError
from megatron_dapo.observe.audit import RESPONSE_FLAGS, answer_line
from megatron_dapo.observe.rows import SAMPLES_DIR, SampleRow, dump_files, file_step, read_rows

PROMPT_TAIL = 300  # prompts share a long instruction; their end (the problem) is what differs
_BOLD, _HIGHLIGHT, _RESET = "\x1b[1m", "\x1b[1;33m", "\x1b[0m"
_ALARM_FILE = re.compile(r"^alarm_\d{8}_([a-z_]+)\.jsonl$")
_COMPARISON = re.compile(r"^([a-z_]+)\s*(!=|>=|<=|=|>|<)\s*(.*)$")
_ORDER = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}

# Named predicates: the questions asked most often of a dump, one word each.
PREDICATES = {
    "wrong": lambda r: not r.acc,
    "correct": lambda r: bool(r.acc),
    "truncated": lambda r: r.finish_reason == "length",
    "kept": lambda r: r.kept is True,  # evaluation rows (kept None) are neither kept nor dropped
    "dropped": lambda r: r.kept is False,
    "flagged": lambda r: bool(r.flags),
    "eval": lambda r: r.phase == "eval",
    "train": lambda r: r.phase == "train",
    "disagree": lambda r: r.audit_acc is not None and bool(r.audit_acc) != bool(r.acc),
}


def _field_kind(annotation: str) -> tuple[str, bool]:
    """(kind, optional) of a SampleRow field from its annotation text (the module uses postponed
    annotations), so that a value is parsed once, before any file is read."""
    optional = "None" in annotation
    for kind in ("list", "bool", "int", "float"):
        if annotation.startswith(kind):
            return ("number" if kind in ("int", "float") else kind), optional
    return "str", optional


FIELDS = {f.name: _field_kind(str(f.type)) for f in dataclasses.fields(SampleRow)}


def _term_error(term: str) -> InputError:
    return InputError(f"unknown --where term {term!r}: use a predicate ({', '.join(PREDICATES)}; '!' negates) "
                      f"or field=value, !=, >, < on a field ({', '.join(FIELDS)})")


def _value(name: str, text: str):
    """The comparison's right-hand side as the field's type: numbers compare as numbers."""
    kind, optional = FIELDS[name]
    if optional and text.lower() in ("none", "null"):
        return None
    if kind == "bool":
        if text.lower() not in ("true", "false"):
            raise InputError(f"--where: {name} is true or false, got {text!r}")
        return text.lower() == "true"
    if kind == "number":
        try:
            return float(text)
        except ValueError:
            raise InputError(f"--where: {name} is a number, got {text!r}") from None
    return text


def _comparison(term: str, name: str, op: str, text: str):
    """A predicate for ``name op text``; ``flags=X`` asks whether X is among the row's flags."""
    if name not in FIELDS:
        raise InputError(f"unknown field {name!r} in --where term {term!r}; fields: {', '.join(FIELDS)}")
    kind = FIELDS[name][0]
    if op in _ORDER and kind != "number":
        raise InputError(f"--where term {term!r}: {op} compares numbers, and {name} is not one")
    if kind == "list":  # a typo'd flag would silently match nothing: refuse it
        if text not in RESPONSE_FLAGS:
            raise InputError(f"unknown flag {text!r} in --where term {term!r}; flags: {', '.join(RESPONSE_FLAGS)}")
        return lambda r: (text in getattr(r, name)) == (op == "=")
    value = _value(name, text)
    if op in _ORDER:
        if value is None:
            raise InputError(f"--where term {term!r}: {op} needs a number")
        return lambda r: getattr(r, name) is not None and _ORDER[op](getattr(r, name), value)
    return lambda r: (getattr(r, name) == value) == (op == "=")


def parse_where(expr: str | None) -> list:
    """The predicates of a comma-separated ``--where``; every term must hold for a row."""
    tests = []
    for term in (t.strip() for t in (expr or "").split(",")):
        if not term:
            continue
        name = term[1:].strip() if term.startswith("!") else term
        if name in PREDICATES:
            pred = PREDICATES[name]
            tests.append((lambda r, p=pred: not p(r)) if term.startswith("!") else pred)
            continue
        match = _COMPARISON.match(term)
        if match is None:
            raise _term_error(term)
        tests.append(_comparison(term, *(g.strip() for g in match.groups())))
    return tests


def _alarm_name(path: Path) -> str | None:
    match = _ALARM_FILE.match(path.name)
    return match.group(1) if match else None


def _dump_set(run_dir: Path, alarm: str | None) -> list[Path]:
    """The regular dumps (or one alarm's) of a run; an error that says where it looked if none."""
    folder = Path(run_dir) / SAMPLES_DIR
    files = dump_files(run_dir)
    chosen = [p for p in files if (_alarm_name(p) == alarm if alarm else p.name.startswith("step_"))]
    if chosen:
        return chosen
    if alarm is not None and files:
        names = sorted({_alarm_name(p) for p in files} - {None})
        raise InputError(f"no dumps of alarm {alarm!r} in {folder}; alarms with dumps: {', '.join(names) or 'none'}")
    missing = "no such run directory; " if not Path(run_dir).is_dir() else ""
    raise InputError(f"no sample dumps ({'alarm_*_' + alarm if alarm else 'step_*'}.jsonl) in {folder} ({missing}"
                     "a run writes them every logging.samples_every steps, 0 turns them off)")


def _list_steps(steps: list[int]) -> str:
    """Steps for an error message: all of a short list, the ends of a long one."""
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))} ({len(steps)} steps)"


def _pick_step(files: list[Path], step) -> list[Path]:
    """The files of ``step`` (an int, a number's text or "all"; None: the latest step dumped)."""
    if step == "all":
        return files
    steps = sorted({file_step(p) for p in files})
    if step is None:
        return [p for p in files if file_step(p) == steps[-1]]
    try:
        target = int(step)
    except ValueError:
        raise InputError(f"--step takes a step number or 'all', got {step!r}") from None
    if target not in steps:
        raise InputError(f"no dump for step {target}; steps with dumps: {_list_steps(steps)} (or --step all)")
    return [p for p in files if file_step(p) == target]


def _select(run_dir, step, where, disagree, alarm, phase) -> tuple[list[Path], list[tuple[Path, SampleRow]]]:
    """(files read, matching rows in file order); the filters are checked before any file is read."""
    tests = parse_where(where)
    if disagree:
        tests.append(PREDICATES["disagree"])
    if phase is not None:
        if phase not in ("train", "eval"):
            raise InputError(f"--phase is train or eval, got {phase!r}")
        tests.append(PREDICATES[phase])
    files = _pick_step(_dump_set(Path(run_dir), alarm), step)
    matched = [(path, row) for path in files for row in read_rows(path) if all(t(row) for t in tests)]
    return files, matched


def select_rows(run_dir, step=None, where=None, disagree=False, n=None, alarm=None,
                phase=None) -> list[tuple[Path, SampleRow]]:
    """The rows of a run's dumps that pass every filter (the first ``n`` of them when given)."""
    matched = _select(run_dir, step, where, disagree, alarm, phase)[1]
    return matched if n is None else matched[:n]


def _short(text: str | None, limit: int = 40) -> str:
    """A pred or truth quoted (an empty pred shows as ''), clipped to keep the header one line."""
    return "-" if text is None else repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3g}"


def _verdict(scorer: str, acc: bool | None, pred: str | None) -> str:
    word = "?" if acc is None else ("correct" if acc else "wrong")
    return f"{scorer} {word} pred {_short(pred)}"


def header(row: SampleRow) -> str:
    """One line with everything a row says about its response but the texts."""
    parts = [f"step {row.step} {row.phase}", f"prompt {row.prompt_index}",
             f"group {row.group} response {row.response_index}", _verdict(row.scorer, row.acc, row.pred)]
    if row.audit_scorer is not None:
        parts.append(_verdict(row.audit_scorer, row.audit_acc, row.audit_pred))
    parts.append(f"truth {_short(row.ground_truth)}")
    if row.reward is not None or row.advantage is not None:
        parts.append(f"reward {_signed(row.reward)} adv {_signed(row.advantage)}")
    if row.kept is not None:
        parts.append("kept" if row.kept else "dropped")
    parts += [f"finish {row.finish_reason}", f"{row.response_tokens} tokens", f"weights v{row.weight_version}",
              "flags " + ",".join(row.flags) if row.flags else "no flags"]
    return " | ".join(parts)


def _response_lines(text: str, color: bool) -> list[str]:
    """The response indented, its answer line (the last with an ``Answer:`` label) marked."""
    lines = text.splitlines() or [""]
    answer = answer_line(text)
    # answer_line reads only the tail, so its line may be the end of a longer one: match by containment
    mark = next((i for i in range(len(lines) - 1, -1, -1) if answer and answer in lines[i]), None)
    out = []
    for i, line in enumerate(lines):
        if i != mark:
            out.append("    " + line)
        else:
            out.append(f"    {_HIGHLIGHT}{line}{_RESET}" if color else "  >> " + line)
    return out


def format_row(row: SampleRow, color: bool = False) -> str:
    """A row as a block: header, prompt tail, response (answer line bold yellow, or ``>> `` without colour)."""
    prompt = row.prompt if len(row.prompt) <= PROMPT_TAIL else "..." + row.prompt[-PROMPT_TAIL:]
    head = f"{_BOLD}{header(row)}{_RESET}" if color else header(row)
    lines = [head, "  prompt:", *(("    " + p).rstrip() for p in prompt.splitlines()),
             f"  response ({row.response_chars} chars):", *_response_lines(row.response, color)]
    return "\n".join(lines)


def _scope(files: list[Path], alarm: str | None) -> str:
    steps = sorted({file_step(p) for p in files})
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} ({len(files)} files)"
    return f"alarm {alarm} dumps, {where}" if alarm else where


def main(args) -> int:
    """The ``samples`` subcommand (cli.py parses the arguments)."""
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    files, matched = _select(args.run_dir, args.step, args.where, args.disagree, args.alarm, args.phase)
    shown = matched[: args.n]
    for _, row in shown:
        print(format_row(row, color) + "\n")
    more = f"; --n {len(matched)} shows all" if len(shown) < len(matched) else ""
    print(f"{len(matched)} matched in {_scope(files, args.alarm)}, {len(shown)} shown{more}", flush=True)
    return 0
