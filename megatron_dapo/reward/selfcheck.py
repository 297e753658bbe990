"""Reward self-check on a real eval set: each ground truth written in the surface forms models
use, plus near-miss wrong answers, scored through the reward pool.

This is what ``megatron-dapo score --data F`` runs when no responses file is given: it proves on
the real answers of a data set that every accepted form scores correct and that no wrong answer
does, and measures the pool's throughput, before any model is involved.
"""

import os
from collections.abc import Callable

FILLER = ("Let me work through this carefully. We set up the equations, simplify, and check each case. "
          "Substituting back confirms the value. ")

# (name, expected acc, render(ground_truth as int) -> final answer text or None when not applicable)
FORMS: list[tuple[str, bool, Callable[[int], str | None]]] = [
    ("plain", True, lambda v: f"Answer: {v}"),
    ("dollar", True, lambda v: f"Answer: ${v}$"),
    ("boxed", True, lambda v: f"Answer: $\\boxed{{{v}}}$"),
    ("bold label", True, lambda v: f"**Answer:** {v}"),
    ("trailing period", True, lambda v: f"Answer: {v}."),
    ("decimal .0", True, lambda v: f"Answer: {v}.0"),
    ("equation", True, lambda v: f"Answer: x = {v}"),
    ("latex paren", True, lambda v: f"Answer: \\({v}\\)"),
    ("text unit", True, lambda v: f"Answer: {v} \\text{{ degrees}}"),
    ("fraction", True, lambda v: f"Answer: $\\frac{{{2 * v}}}{{2}}$"),
    ("thousands sep", True, lambda v: f"Answer: {v:,}" if abs(v) >= 1000 else None),
    ("unicode minus", True, lambda v: f"Answer: \u2212{-v}" if v < 0 else None),
    ("last line wins", True, lambda v: f"Answer: {v + 1}\nWait, I made an error.\nAnswer: {v}"),
    ("off by one", False, lambda v: f"Answer: {v + 1}"),
    ("times ten", False, lambda v: f"Answer: {v * 10}"),
    ("digit prefix", False, lambda v: f"Answer: {str(v)[:-1]}" if len(str(abs(v))) > 1 else None),
    ("decimal shift", False, lambda v: f"Answer: {v / 10}"),
    ("negated", False, lambda v: f"Answer: {-v}" if v != 0 else None),
    ("two answers", False, lambda v: f"Answer: {v} or {v + 1}"),
    ("boxed, no Answer line", False, lambda v: f"So the result is $\\boxed{{{v}}}$."),
    ("earlier right, last wrong", False, lambda v: f"Answer: {v}\nHmm, recheck.\nAnswer: {v + 2}"),
]


def build_cases(ground_truths: list[str]) -> list[tuple[str, bool, str, str]]:
    """[(form name, expected acc, response, ground truth)] for every integer ground truth and form."""
    from megatron_dapo.reward.math_dapo import integer_ground_truth

    cases = []
    for gt in ground_truths:
        value = integer_ground_truth(gt)
        if value is None:
            continue  # self-check forms are defined for integer answers (DAPO-Math, AIME)
        for name, expected, render in FORMS:
            answer = render(value)
            if answer is not None:
                cases.append((name, expected, FILLER + "\n" + answer, gt))
    return cases


def run_selfcheck(paths: list[str], *, num_workers: int, timeout_s: float, on_bad_row: str) -> int:
    """Loads ``paths``, scores every form of every unique answer, prints a table; exit code 1 on any
    false positive or rejected correct form. InputError when no ground truth can be checked (no
    rows, or none an integer): an empty table and exit code 0 would read as a passed check."""
    import time

    from megatron_dapo.data import load_prompts
    from megatron_dapo.data.prepare import non_integer_ground_truths, quoted
    from megatron_dapo.data.schema import DAPO_FILE
    from megatron_dapo.errors import InputError
    from megatron_dapo.reward.math_dapo import integer_ground_truth
    from megatron_dapo.reward.pool import RewardPool

    loaded = load_prompts(paths, dedup=True, on_bad_row=on_bad_row)
    truths = [r.ground_truth for r in loaded.records]
    non_integer = non_integer_ground_truths(loaded.records, integer_ground_truth)
    where = ", ".join(map(str, paths))  # --data, or data.val_files when it is not given
    if not truths:
        skipped = f", {loaded.num_skipped} skipped as bad" if loaded.num_skipped else ""
        raise InputError(f"{where}: nothing to self-check ({loaded.num_rows} rows{skipped}); give {DAPO_FILE}")
    if len(non_integer) == len(truths):
        which = ("its one ground truth is not an integer" if len(truths) == 1
                 else f"none of its {len(truths)} ground truths is an integer")
        raise InputError(f"{where}: nothing to self-check: {which} ({quoted(non_integer)}), and the self-check "
                         "writes integer answers in the forms models use; give integer-answer data such as "
                         "DAPO-Math-17K or AIME")
    print(f"data: {len(loaded.records)} unique prompts from {loaded.num_rows} rows "
          f"({loaded.num_duplicates} duplicates merged, {loaded.num_skipped} skipped"
          + (f", {len(non_integer)} with a non-integer ground truth not checked" if non_integer else "") + ")")
    cases = build_cases(truths)
    with RewardPool(num_workers=num_workers, timeout_s=timeout_s) as pool:
        start = time.perf_counter()
        results = pool.score([c[2] for c in cases], [c[3] for c in cases])
        seconds = time.perf_counter() - start
    by_form: dict[str, list[int]] = {}
    for (name, expected, _, _), res in zip(cases, results):
        stats = by_form.setdefault(name, [0, 0, int(expected)])
        stats[0] += int(res["acc"])
        stats[1] += 1
    print(f"{'form':28s} {'expected':>8s} {'scored correct':>15s}")
    bad = 0
    for name, (num_acc, num, expected) in by_form.items():
        wrong = (num - num_acc) if expected else num_acc
        bad += wrong
        flag = "" if wrong == 0 else f"   <-- {wrong} mis-scored"
        print(f"{name:28s} {'correct' if expected else 'wrong':>8s} {num_acc:>7d} / {num:<6d}{flag}")
    num_fp = sum(1 for (_, e, _, _), r in zip(cases, results) if r["acc"] and not e)
    print(f"{len(cases)} responses in {seconds:.2f} s ({len(cases) / seconds:.0f}/s, {num_workers} workers); "
          f"false positives: {num_fp}; timeouts: {pool.num_timeouts}; mis-scored in all: {bad}")
    return 1 if bad else 0


def score_file(path: str, out: str | None, *, num_workers: int, timeout_s: float) -> int:
    """Scores a JSONL of {"response", "ground_truth"} rows; prints accuracy, writes rows + scores."""
    import json

    from megatron_dapo.errors import InputError
    from megatron_dapo.reward.pool import RewardPool

    if not os.path.isfile(path):
        raise InputError(f"--responses {path}: no such file")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path}: line {line_no}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("response"), str) or "ground_truth" not in row:
                raise InputError(f"{path}: line {line_no}: needs a string 'response' and a 'ground_truth'")
            rows.append(row)
    with RewardPool(num_workers=num_workers, timeout_s=timeout_s) as pool:
        results = pool.score([r["response"] for r in rows], [str(r["ground_truth"]) for r in rows])
    num_acc = sum(r["acc"] for r in results)
    print(f"{path}: {num_acc} / {len(rows)} correct ({num_acc / max(1, len(rows)):.4f}); "
          f"timeouts: {pool.num_timeouts}")
    if out:
        with open(out, "w") as fh:
            for row, res in zip(rows, results):
                fh.write(json.dumps({**row, **res}) + "\n")
    return 0
