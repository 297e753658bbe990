"""A synthetic verifiable task for the CPU demo: "which digit is the largest?".

Each problem is a string of ``num_digits`` digits (or of a length uniform in [min_digits,
num_digits], so that responses with the reasoning line vary in length); the answer is the largest one, an integer that
the DAPO reward fn (``megatron_dapo.reward.compute_score``) reads from the final ``Answer:`` line
exactly as it reads AIME answers. Rows use the DAPO/verl parquet schema of data/aime-2024.parquet
(``prompt`` chat messages, ``reward_model.ground_truth`` integer string, ``data_source``,
``ability``, ``extra_info``), so the normal loader, tokenizer and reward paths are exercised.

Why this task: a ~0.1M-parameter transformer can learn "max" with one attention read, and the
space of problems (~10 ** num_digits) is large enough that held-out problems are really unseen.
Answers are uniform over 3..9 (see ``MIN_ANSWER``), so no constant answer scores above 1/7. A
model that knows only the response format answers a uniformly random digit and scores 0.1, far
below the 0.8 the demo must reach.

Deviation from DAPO: the prompt is a short question instead of the 60-word DAPO template
(docs/reference/dapo.md 1.7), because every prompt token costs time on 2 CPU cores and a model trained
from scratch gains nothing from the instruction text.

Response format (what the warm-up teaches, see ``format_response``)::

    Check 37194.            <- optional "reasoning" line (the digits, copied)
    Answer: 9
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "toy"
ABILITY = "TOY"
REWARD_STYLE = "rule"
QUESTION = "Largest digit of {digits}?"
"""The user message; ``{digits}`` is the digit string, e.g. "37194" (Qwen spells numbers digit by digit)."""
REASONING = "Check {digits}."
"""The optional reasoning line of a response: restates the digits, gives nothing away."""
ANSWER_LINE = "Answer: {answer}"

MIN_ANSWER = 3
"""Answers are drawn uniformly from MIN_ANSWER..9, not from the max of uniform digits. With
uniform digits the answer is 9 a third of the time (4 digits), and the RL policy collapsed onto
"always 9" (one answer, entropy near 0, no mixed groups left) before it learned to read the
digits (measured with an early plain-torch prototype of the loop); with uniform answers no constant answer
beats 1/7. Small answers are left out because they have too few distinct problems (answer 1 has
2 ** n - 1) for disjoint train and validation splits of the same distribution."""

_QUESTION_RE = re.compile(r"^Largest digit of (\d+)\?$")


def make_problem(rng: random.Random, num_digits: int, answer: int) -> list[int]:
    """Digits of a problem whose answer is ``answer``: uniform over the ``num_digits``-digit
    strings with largest digit ``answer``."""
    if num_digits < 2 or not MIN_ANSWER <= answer <= 9:
        raise ValueError(f"need num_digits >= 2 and {MIN_ANSWER} <= answer <= 9, got {num_digits}, {answer}")
    while True:  # rejection: uniform over [0, answer]^n, keep strings that contain `answer`
        digits = [rng.randint(0, answer) for _ in range(num_digits)]
        if answer in digits:
            return digits


def sample_problem(rng: random.Random, num_digits: int, min_digits: int | None = None) -> tuple[list[int], int]:
    """(digits, answer) with the answer uniform in MIN_ANSWER..9 (see ``MIN_ANSWER``) and the length
    uniform in [min_digits, num_digits] (``num_digits`` when ``min_digits`` is 0 or None)."""
    answer = rng.randint(MIN_ANSWER, 9)
    return make_problem(rng, _length(rng, min_digits, num_digits), answer), answer


def _length(rng: random.Random, lo: int | None, hi: int) -> int:
    # A fixed length draws nothing, so fixed-length data is the same as before lengths could vary.
    return hi if not lo or lo == hi else rng.randint(lo, hi)


def num_problems(num_digits: int, answer: int) -> int:
    """How many distinct ``num_digits``-digit strings have largest digit ``answer``."""
    return (answer + 1) ** num_digits - answer ** num_digits


def format_question(digits: list[int]) -> str:
    return QUESTION.replace("{digits}", "".join(map(str, digits)))


def parse_question(text: str) -> list[int]:
    """The digits of a question written by ``format_question`` (ValueError otherwise)."""
    match = _QUESTION_RE.match(text)
    if match is None:
        raise ValueError(f"not a toy question: {text!r}")
    return [int(d) for d in match.group(1)]


def format_response(digits: list[int], answer: int | str, *, reasoning: bool) -> str:
    """A response in the taught format; ``answer`` need not be correct (the warm-up uses random ones)."""
    line = ANSWER_LINE.replace("{answer}", str(answer))
    if not reasoning:
        return line
    return REASONING.replace("{digits}", "".join(map(str, digits))) + "\n" + line


def make_row(digits: list[int], answer: int, *, split: str, index: int) -> dict[str, Any]:
    """One row in the DAPO/verl schema (the columns of data/aime-2024.parquet)."""
    question = format_question(digits)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": str(answer), "style": REWARD_STYLE},
        "extra_info": {"index": index, "split": split, "raw_problem": question},
    }


def make_splits(*, seed: int, num_train: int, num_val: int, num_digits: int, min_digits: int | None = None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and validation rows from one distribution, a pure function of the arguments.

    Problems are unique within and across splits, so held-out accuracy measures generalisation
    rather than recall. Validation is drawn first so that changing ``num_train`` keeps it fixed.
    With ``min_digits`` the length of each problem is uniform in [min_digits, num_digits].
    """
    lo = min_digits or num_digits  # 0 / None: every problem has num_digits (ToyConfig's convention)
    if not 2 <= lo <= num_digits:
        raise ValueError(f"need 2 <= min_digits <= num_digits, got {min_digits}, {num_digits}")
    answers = list(range(MIN_ANSWER, 10))
    # Every (length, answer) bucket gets an equal share of the rows; demand 2x headroom in the
    # smallest so that uniqueness never starves it (a starved bucket would skew train against val).
    smallest = num_problems(lo, MIN_ANSWER)
    if 2 * (num_train + num_val) / (len(answers) * (num_digits - lo + 1)) > smallest:
        raise ValueError(f"{num_train} + {num_val} problems is too many for {lo} digits: answer "
                         f"{MIN_ANSWER} has only {smallest} distinct problems; use fewer or raise the digits")
    # str seeds hash stably across runs; the fixed-length name is the one data was always made with
    rng = random.Random(f"toy-max-{seed}-{num_digits}" if lo == num_digits else f"toy-max-{seed}-{lo}-{num_digits}")
    seen: set[tuple[int, ...]] = set()
    splits: dict[str, list[dict[str, Any]]] = {"val": [], "train": []}
    for split, count in (("val", num_val), ("train", num_train)):
        for index in range(count):
            answer = rng.randint(MIN_ANSWER, 9)
            length = _length(rng, lo, num_digits)
            digits = make_problem(rng, length, answer)
            while tuple(digits) in seen:  # redraw with the same answer and length, keeping both uniform
                digits = make_problem(rng, length, answer)
            seen.add(tuple(digits))
            splits[split].append(make_row(digits, answer, split=split, index=index))
    return splits["train"], splits["val"]


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_toy_dataset(out_dir: str | Path, *, seed: int, num_train: int, num_val: int,
                      num_digits: int, min_digits: int | None = None) -> tuple[Path, Path]:
    """Writes ``out_dir/train.parquet`` and ``out_dir/val.parquet``; returns their paths."""
    train, val = make_splits(seed=seed, num_train=num_train, num_val=num_val, num_digits=num_digits,
                             min_digits=min_digits)
    out_dir = Path(out_dir)
    return write_parquet(train, out_dir / "train.parquet"), write_parquet(val, out_dir / "val.parquet")


def vocabulary_texts() -> list[str]:
    """Every kind of text the task produces (for building a tokenizer that covers it)."""
    all_digits = list(range(10))
    return [format_question(all_digits), format_response(all_digits, 0, reasoning=True)]
