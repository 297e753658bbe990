"""Load DAPO-format prompt files (parquet or JSONL) into deduplicated `PromptRecord`s.

Row formats (both file types, one row = one parquet row or one JSONL line):

* DAPO/verl format, as in BytedTsinghua-SIA/DAPO-Math-17k: `prompt` (list of {role,
  content}), `reward_model.ground_truth`, and optional `data_source`, `ability`, `extra_info`.
* Raw format, for hand-written JSONL: no `prompt`, but a `problem` string and an `answer` (or
  `ground_truth`) field. The prompt is built with `format_dapo_prompt`, and `raw_problem` is
  added to `extra_info` as in the AIME-2024 file.

Missing `data_source` / `ability` become "math_dapo" / "MATH", since every file this loader is
meant for is DAPO math. An integer ground truth is converted with str(); floats and other types
are rejected because their text form is ambiguous (1e-05, 3.0).

Deduplication: DAPO-Math-17K has ~1.79M rows but only ~17k unique prompts ("duplicated by ~100x
by accident", HF discussion quoted in BytedTsinghua-SIA/DAPO#36). Rows are merged when their
messages (roles and contents) are identical; the merged record counts them in `num_copies` and
keeps the first row's metadata (copies may differ in extra_info, e.g. its index). The
same prompt with two different ground truths is a data error. Parquet is streamed by record
batches and one record per unique prompt is kept, so memory grows with unique prompts, not rows.
With dedup=False every good row is kept, so memory then grows with the rows.

Bad rows raise `InputError` (a ValueError, printed by the CLI as one line) naming the file, row and
field; so do a missing or unreadable file and a parquet file without the columns of either format. With
on_bad_row="skip" they are counted by reason in `LoadResult.skipped`. A prompt whose copies disagree on the ground
truth is then dropped entirely (all of its rows count as "conflicting_ground_truth"), since nothing says
which answer is right. Invariant: num_rows == sum(num_copies) + sum(skipped.values()).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from megatron_dapo.data.schema import Message, PromptRecord, format_dapo_prompt, prompt_key
from megatron_dapo.errors import InputError, one_line

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "math_dapo"
DEFAULT_ABILITY = "MATH"
ON_BAD_ROW_CHOICES = ("error", "skip")
# Only these columns are read from parquet; pandas index columns and the like are ignored.
_COLUMNS = ("prompt", "reward_model", "data_source", "ability", "extra_info", "problem", "answer",
            "ground_truth")
_NUM_EXAMPLES_LOGGED = 5
ROWS_REPORTED = 10_000  # load_prompts' on_rows: how often
# How a run turns skipping on, quoted in a bad row's error; prepare-data passes its own flag instead.
SKIP_ADVICE = "set data.on_bad_row=skip"


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """Unique prompts of one or more files, with row accounting."""

    records: tuple[PromptRecord, ...]
    """Unique prompts in order of first appearance."""
    num_rows: int
    """Rows read from all files, good or bad (blank JSONL lines are not rows)."""
    num_duplicates: int
    """Rows merged into an earlier identical row: sum(num_copies - 1) over `records`."""
    skipped: dict[str, int]
    """Rows dropped under on_bad_row="skip", by reason; empty in "error" mode."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


class _BadRow(Exception):
    """A malformed row; `reason` is the key in LoadResult.skipped."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(f"field '{field}': {detail}")
        self.reason = reason


def load_prompts(paths: str | os.PathLike | Sequence[str | os.PathLike], *, dedup: bool = True,
                 on_bad_row: str = "error", batch_size: int = 8192,
                 on_rows: Callable[[int], None] | None = None, skip_advice: str = SKIP_ADVICE) -> LoadResult:
    """Read prompt files (.parquet or .jsonl) and merge identical prompts.

    Args:
        paths: one path or a list; duplicates are merged across files too.
        dedup: merge identical prompts (True) or keep one record per row (False; copies then
            share the same `index`, and ground-truth conflicts are still detected).
        on_bad_row: "error" raises ValueError at the first bad row; "skip" counts and drops it.
        batch_size: parquet rows decoded at a time; bounds the transient memory of a read.
        on_rows: told the rows read so far, every ``ROWS_REPORTED`` rows (progress of a long read).
        skip_advice: how the caller's user switches to "skip", named in a bad row's error (the
            config key for a run, a flag for a command that has one).
    """
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_CHOICES}, got {on_bad_row!r}")
    path_list = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not path_list:
        raise ValueError("load_prompts needs at least one path")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    readers = [_reader_for(Path(p), batch_size) for p in path_list]  # fail before reading anything

    # Keyed by the messages tuple itself (hashable, and cheaper than hashing every row's text);
    # the key objects are those of the first copy, so later copies are freed after their check.
    kept: list[list[Any]] = []  # [messages, ground_truth, data_source, ability, extra, count]
    first_seen: dict[tuple[Message, ...], tuple[str, str]] = {}  # -> (ground truth, where)
    position: dict[tuple[Message, ...], int] = {}  # -> slot in `kept`, dedup mode only
    conflicted: set[tuple[Message, ...]] = set()
    skipped: Counter[str] = Counter()
    examples: list[str] = []
    num_rows = 0

    def skip(reason: str, message: str) -> None:
        if on_bad_row == "error":
            raise InputError(f"{message} (fix the row, or {skip_advice} to count and drop bad rows)")
        skipped[reason] += 1
        if len(examples) < _NUM_EXAMPLES_LOGGED:
            examples.append(message)

    for reader in readers:
        for where, row in reader:
            num_rows += 1
            if on_rows is not None and num_rows % ROWS_REPORTED == 0:
                on_rows(num_rows)
            try:
                messages, ground_truth, data_source, ability, extra = _parse_row(row)
            except _BadRow as err:
                skip(err.reason, f"{where}: {err}")
                continue
            key = messages
            if key in conflicted:
                skip("conflicting_ground_truth", f"{where}: prompt already dropped for a conflict")
                continue
            if key in first_seen and first_seen[key][0] != ground_truth:
                first_gt, first_where = first_seen[key]
                skip("conflicting_ground_truth",
                     f"{where}: field 'reward_model.ground_truth': {ground_truth!r} conflicts with "
                     f"{first_gt!r} for the same prompt at {first_where}")
                conflicted.add(key)
                continue
            first_seen.setdefault(key, (ground_truth, where))
            if dedup and key in position:
                kept[position[key]][5] += 1
                continue
            position[key] = len(kept)
            kept.append([messages, ground_truth, data_source, ability, extra, 1])

    if conflicted:  # earlier copies of a conflicted prompt are dropped too, see module docstring
        skipped["conflicting_ground_truth"] += sum(k[5] for k in kept if k[0] in conflicted)
        kept = [k for k in kept if k[0] not in conflicted]
    records = tuple(
        PromptRecord(messages=m, ground_truth=gt, data_source=ds, ability=ab, extra_info=ex,
                     index=prompt_key(m)[:16], num_copies=n)
        for m, gt, ds, ab, ex, n in kept
    )
    if skipped:
        logger.warning("Skipped %d of %d rows in %s: %s. First examples:\n  %s",
                       sum(skipped.values()), num_rows, [str(p) for p in path_list],
                       dict(skipped), "\n  ".join(examples))
    return LoadResult(records=records, num_rows=num_rows,
                      num_duplicates=sum(r.num_copies - 1 for r in records), skipped=dict(skipped))


def _reader_for(path: Path, batch_size: int) -> Iterator[tuple[str, Any]]:
    """A (where, row) iterator for `path`, checking existence and extension up front."""
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _iter_parquet(path, batch_size)
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    raise InputError(f"unknown prompt file extension {suffix!r} for {path}; "
                     "supported: .parquet, .jsonl")


def _iter_parquet(path: Path, batch_size: int) -> Iterator[tuple[str, Any]]:
    """Rows of a parquet file as dicts, decoding one record batch at a time."""
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for one problem
        raise InputError(f"{path}: not a readable parquet file ({one_line(e)})") from None
    columns = [c for c in file.schema_arrow.names if c in _COLUMNS]
    if file.metadata.num_rows and not {"prompt", "problem"} & set(columns):
        raise InputError(f"{path}: no 'prompt' or 'problem' column (it has {file.schema_arrow.names}); "
                         "expected DAPO rows (prompt, reward_model.ground_truth) or raw rows (problem, answer)")
    row = 0
    for batch in file.iter_batches(batch_size=batch_size, columns=columns):
        for item in batch.to_pylist():
            yield f"{path}: row {row}", item
            row += 1


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a JSONL file (1-based line numbers); undecodable lines come back as _BadRow."""
    # Binary mode so that invalid UTF-8 is a bad line, not an error that aborts the whole file.
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
                item = _BadRow("bad_json", "<line>", f"invalid JSON: {err}")
            yield f"{path}: line {line_number}", item


def _parse_row(row: Any) -> tuple[tuple[Message, ...], str, str, str, dict]:
    """Validate one row; returns (messages, ground_truth, data_source, ability, extra_info)."""
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow("bad_json", "<line>", f"expected a JSON object, got {type(row).__name__}")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise _BadRow("bad_metadata", "extra_info", f"expected an object, got {type(extra).__name__}")
    if row.get("prompt") is not None:
        messages = _parse_messages(row["prompt"])
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise _BadRow("missing_ground_truth", "reward_model.ground_truth", "missing")
        ground_truth = _as_ground_truth(reward_model["ground_truth"], "reward_model.ground_truth")
    elif row.get("problem") is not None:
        messages = _parse_problem(row["problem"])
        ground_truth = _raw_ground_truth(row)
        extra = {**extra, "raw_problem": extra.get("raw_problem", row["problem"])}
    else:
        raise _BadRow("missing_prompt", "prompt", "missing (and no raw 'problem' field either)")
    data_source = _optional_str(row, "data_source", DEFAULT_DATA_SOURCE)
    ability = _optional_str(row, "ability", DEFAULT_ABILITY)
    return messages, ground_truth, data_source, ability, extra


def _parse_messages(prompt: Any) -> tuple[Message, ...]:
    """A non-empty list of {role, content} with non-empty string values and no other keys."""
    if not isinstance(prompt, list) or not prompt:
        raise _BadRow("bad_prompt", "prompt", f"expected a non-empty list of messages, got {prompt!r:.80}")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise _BadRow("bad_prompt", f"prompt[{i}]",
                          f"expected a {{role, content}} object, got {message!r:.80}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise _BadRow("bad_prompt", f"prompt[{i}].role", f"expected a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise _BadRow("bad_prompt", f"prompt[{i}].content",
                          f"expected a string, got {type(content).__name__}")
        if not content.strip():
            raise _BadRow("empty_content", f"prompt[{i}].content", "empty")
        messages.append(Message(role=role, content=content))
    return tuple(messages)


def _parse_problem(problem: Any) -> tuple[Message, ...]:
    if not isinstance(problem, str):
        raise _BadRow("bad_prompt", "problem", f"expected a string, got {type(problem).__name__}")
    if not problem.strip():
        raise _BadRow("empty_content", "problem", "empty")
    return format_dapo_prompt(problem)


def _raw_ground_truth(row: dict) -> str:
    """`answer` or `ground_truth` of a raw row; both may be given only if they agree."""
    given = {f: _as_ground_truth(row[f], f) for f in ("answer", "ground_truth") if row.get(f) is not None}
    if not given:
        raise _BadRow("missing_ground_truth", "answer", "missing (nor is 'ground_truth' given)")
    if len(set(given.values())) > 1:
        raise _BadRow("bad_ground_truth", "answer", f"'answer' and 'ground_truth' disagree: {given}")
    return next(iter(given.values()))


def _as_ground_truth(value: Any, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadRow("bad_ground_truth", field, f"expected a string or integer, got {value!r:.80}")
    text = str(value)
    if not text.strip():
        raise _BadRow("bad_ground_truth", field, "empty")
    return text


def _optional_str(row: dict, field: str, default: str) -> str:
    value = row.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _BadRow("bad_metadata", field, f"expected a string, got {type(value).__name__}")
    return value
