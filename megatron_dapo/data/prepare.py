"""``megatron-dapo prepare-data``: the files as users download them -> the files a run reads.

DAPO-Math-17K ships ~1.79M rows for ~17k unique prompts (each repeated ~100x by accident), and the
AIME-2024 file ships each of its 30 problems 32 times (for avg@32 by repetition). The trainer
deduplicates on load either way; preparing once writes the unique prompts (with their copy count in
``extra_info.num_copies``) so that every later load is fast and the counts are known up front.

    megatron-dapo prepare-data --train dapo-math-17k.parquet --eval aime-2024.parquet --out data/prepared

writes ``<out>/train.parquet``, ``<out>/eval.parquet`` (DAPO/verl schema, as data.train_files /
data.val_files expect) and ``<out>/prepare.json`` (the counts printed). A bad row stops the job
with its file, row and field (``--on-bad-row skip`` counts and drops bad rows instead, reported
by reason). Nothing is written unless every input loads.

A ground truth that is not an integer (``\\frac{1}{2}``, ``0.5``) is kept, counted and warned
about, not treated as a bad row: the reward scores it (reward/math_dapo.py, and the paper's rule),
but by exact match of the normalised strings, not by value, so a right answer in another form
(``1/2`` against ``\\frac{1}{2}``) scores wrong. DAPO-Math-17K's and AIME's answers are all integers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_dapo.data.loading import LoadResult, load_prompts
from megatron_dapo.data.schema import PromptRecord
from megatron_dapo.errors import InputError, shown

REPORT = "prepare.json"
PROGRESS_EVERY_S = 5.0  # between two progress lines of a long read
NUM_EXAMPLES = 3  # non-integer ground truths quoted in the warning


def to_row(record: PromptRecord) -> dict[str, Any]:
    """One row in the DAPO/verl schema (the columns of data/aime-2024.parquet)."""
    return {"data_source": record.data_source, "prompt": record.chat(), "ability": record.ability,
            "reward_model": {"ground_truth": record.ground_truth, "style": "rule"},
            "extra_info": {**record.extra_info, "num_copies": record.num_copies}}


def _write(records: tuple[PromptRecord, ...], path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    try:
        table = pa.Table.from_pylist([to_row(r) for r in records])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # extra_info of mixed types across rows
        raise InputError(f"cannot write {path}: the rows' extra_info fields differ in type ({e})") from None
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # a crash never leaves a half-written file under the final name


IntegerReader = Callable[[str], int | None]  # a ground truth -> its integer, None when it is not one


def non_integer_ground_truths(records: tuple[PromptRecord, ...], integer: IntegerReader) -> list[str]:
    """The ground truths of ``records`` that ``integer`` cannot read as an integer, in order."""
    return [r.ground_truth for r in records if integer(r.ground_truth) is None]


def _counts(name: str, files: list[str], loaded: LoadResult, non_integer: int) -> dict[str, Any]:
    return {"split": name, "files": files, "rows": loaded.num_rows, "unique_prompts": len(loaded.records),
            "duplicate_rows": loaded.num_duplicates, "skipped_rows": loaded.skipped,
            "non_integer_ground_truths": non_integer}


def quoted(ground_truths: list[str]) -> str:
    """The first few distinct values of ``ground_truths``, quoted as written (for a message)."""
    return ", ".join(shown(gt) for gt in list(dict.fromkeys(ground_truths))[:NUM_EXAMPLES])


def _non_integer_warning(name: str, records: tuple[PromptRecord, ...], found: list[str]) -> str | None:
    if not found:
        return None
    examples = quoted(found)
    return (f"prepare-data: warning: --{name}: {len(found):,} of {len(records):,} prompts have a ground truth that is "
            f"not an integer ({examples}); the reward matches those as normalised strings, not by value, so a right "
            f"answer in another form (1/2 for \\frac{{1}}{{2}}) scores wrong: DAPO-Math-17K's and AIME's answers are "
            f"all integers, so check that this is the file you meant, or drop those prompts")


def prepare_data(out_dir: str | os.PathLike, *, train: list[str], integer: IntegerReader,
                 eval: list[str] | None = None, on_bad_row: str = "error", force: bool = False,
                 say: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Loads every input (deduplicated), then writes train.parquet / eval.parquet and the report.
    Returns the per-split counts. ``integer``: the reward's reading of a ground truth as an integer
    (the reward's own definition, given by the caller: the data layer does not import the reward);
    the ground truths it cannot read are counted and warned about. ``say``: progress lines (a read of
    DAPO-Math-17K's 1.79M rows takes ~40 s), at most one every ``PROGRESS_EVERY_S``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {out_dir} is a file; give a directory (it is made if missing)")
    splits = [("train", train), ("eval", eval or [])]
    targets = [out_dir / f"{name}.parquet" for name, files in splits if files]
    if not force and any(p.exists() for p in targets):
        raise InputError(f"{', '.join(str(p) for p in targets if p.exists())} exists; pass --force to replace it")
    loaded = {name: load_prompts(files, dedup=True, on_bad_row=on_bad_row, on_rows=_reporter(name, say),
                                 skip_advice="pass --on-bad-row skip")
              for name, files in splits if files}
    for name, result in loaded.items():
        if not result.records:
            raise InputError(f"--{name} {', '.join(dict(splits)[name])}: no usable rows ({result.num_rows} rows, "
                             f"{result.num_skipped} skipped as bad)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out_dir}: cannot create it ({e.strerror})") from None
    report = []
    for name, result in loaded.items():
        non_integer = non_integer_ground_truths(result.records, integer)
        if warning := _non_integer_warning(name, result.records, non_integer):
            say(warning)
        say(f"prepare-data: writing {out_dir / f'{name}.parquet'} ({len(result.records):,} prompts)")
        _write(result.records, out_dir / f"{name}.parquet")
        report.append(_counts(name, [str(f) for f in dict(splits)[name]], result, len(non_integer)))
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _reporter(split: str, say: Callable[[str], None]) -> Callable[[int], None]:
    """load_prompts' on_rows for ``split``: a line when ``PROGRESS_EVERY_S`` passed since the last."""
    started = last = time.monotonic()

    def on_rows(rows: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            say(f"prepare-data: --{split}: {rows:,} rows read ({rows / (now - started):,.0f} rows/s)")
    return on_rows


def format_report(report: list[dict[str, Any]], out_dir: str | os.PathLike) -> str:
    lines = []
    for r in report:
        skipped = (f", {sum(r['skipped_rows'].values())} bad row(s) skipped {r['skipped_rows']}"
                   if r["skipped_rows"] else "")
        non_integer = (f", {r['non_integer_ground_truths']} with a non-integer ground truth"
                       if r["non_integer_ground_truths"] else "")
        lines.append(f"{r['split']}: {r['rows']} rows -> {r['unique_prompts']} unique prompts "
                     f"({r['duplicate_rows']} duplicate rows merged{skipped}{non_integer}) -> "
                     f"{Path(out_dir) / (r['split'] + '.parquet')}")
    return "\n".join(lines)
