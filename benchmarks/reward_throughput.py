"""Reward throughput and accuracy: our DAPO-Math scorer vs raw math-verify on long responses.

Builds N synthetic responses of about 16k tokens (60-70k characters of chain-of-thought filler:
prose and LaTeX, ending in an "Answer:" line in one of several forms, half correct). It measures
responses per second for
  (a) compute_score in this process,
  (b) RewardPool with 2 worker processes (startup timed separately),
  (c) the baseline verify(parse(gt), parse(full_text)) with math-verify's own 5 s timeouts
      (main thread). It is much slower, so it runs on at most --baseline-num responses.
It also reports the accuracy of each on the labelled table in megatron_dapo/reward/labelled_cases.py. Some
labels there are format policy, not math (a correct \boxed{} without an "Answer:" line is
wrong), so the baseline's "false positives" include such rows.
The last line gives CPU seconds: if the load average exceeds the CPU count, the pool's workers
share cores with other processes, and its rate says little about its scaling.

    python benchmarks/reward_throughput.py [--num 512] [--quick]
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: the package from a checkout

from megatron_dapo.reward import RewardPool, compute_score  # noqa: E402
from megatron_dapo.reward.labelled_cases import CASES  # noqa: E402
from megatron_dapo.reward.math_dapo import warm_up  # noqa: E402

PROSE = [
    "We now consider the case where the sum is even.",
    "Substituting back, the equation simplifies nicely.",
    "Let me double-check this computation, because the answer seems too large.",
    "Hmm, wait, that does not look right; let us recompute the second term.",
    "By the AM-GM inequality the minimum is attained when all terms are equal.",
    "So the number of valid arrangements is the product of the choices at each step.",
    "Counting the complement is easier here.",
]
LATEX = [
    "$x^2 + 3x - 10 = 0$", "$\\frac{a+b}{2} \\geq \\sqrt{ab}$", "$f(3) = 27$",
    "\\[ \\sum_{k=1}^{n} k = \\frac{n(n+1)}{2} \\]", "$\\binom{10}{3} = 120$",
    "$\\angle ABC = 60^\\circ$", "\\[ (a+b)^2 = a^2 + 2ab + b^2 \\]", "$m + n = 17$",
]
FORMS = [
    "Answer: {v}", "Answer: $\\boxed{{{v}}}$", "**Answer:** {v}", "Answer: ${v}$",
    "Answer: {v:,}", "Answer: $x = {v}$", "Answer:\n\\[\n\\boxed{{{v}}}\n\\]",
    "Answer: The final answer is $\\boxed{{{v}}}$. I hope it is correct.",
    "Answer: $\\frac{{{w}}}{{2}}$",
    # These two go through math-verify (a few ms each), the others take the fast paths.
    "Answer: $\\sqrt{{{sq}}}$", "Answer: ${p8} - 2^{{3}}$",
]


def make_responses(num: int, seed: int = 0) -> tuple[list[str], list[str], list[bool]]:
    rng = random.Random(seed)
    responses, truths, labels = [], [], []
    for i in range(num):
        parts, length, target_len = [], 0, rng.randint(60_000, 70_000)
        while length < target_len:
            part = rng.choice(PROSE) if rng.random() < 0.6 else rng.choice(LATEX)
            if rng.random() < 0.05:
                part += "\n\n"
            parts.append(part)
            length += len(part) + 1
        truth = rng.randint(0, 999)
        correct = i % 2 == 0
        value = truth if correct else truth + rng.choice([1, -1, 10, 100])
        answer = rng.choice(FORMS).format(v=value, w=2 * value, sq=value * value, p8=value + 8)
        responses.append(" ".join(parts) + "\n\n" + answer)
        truths.append(str(truth))
        labels.append(correct)
    return responses, truths, labels


def raw_math_verify(response: str, ground_truth: str) -> bool:
    from math_verify import parse, verify

    return verify(parse(f"${ground_truth}$"), parse(response))  # default 5 s signal timeouts


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def table_accuracy(accs: list[bool]) -> str:
    expected = [c[2] for c in CASES]
    num_right = sum(a == e for a, e in zip(accs, expected))
    false_pos = sum(a and not e for a, e in zip(accs, expected))
    false_neg = sum(e and not a for a, e in zip(accs, expected))
    return f"{num_right}/{len(CASES)} (FP {false_pos}, FN {false_neg})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=512, help="number of synthetic responses")
    parser.add_argument("--quick", action="store_true", help="64 responses, 8 for the baseline")
    parser.add_argument("--baseline-num", type=int, default=128, help="cap for raw math-verify")
    args = parser.parse_args()
    num = 64 if args.quick else args.num
    baseline_num = min(num, 8 if args.quick else args.baseline_num)

    responses, truths, labels = make_responses(num)
    mean_chars = sum(map(len, responses)) / num
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())  # pool numbers need idle cores
    print(f"{num} responses, mean {mean_chars:,.0f} chars; baseline on {baseline_num}; "
          f"{os.cpu_count()} CPUs, load average {load}")
    table_r, table_g = [c[0] for c in CASES], [c[1] for c in CASES]
    rows = []

    warm_up()  # import math-verify outside the timed region
    cpu = time.process_time()
    ours, sec = timed(lambda: [compute_score(r, g)["acc"] for r, g in zip(responses, truths)])
    notes = [f"compute_score: {time.process_time() - cpu:.2f} CPU s in {sec:.2f} wall s"]
    table = [compute_score(r, g)["acc"] for r, g in zip(table_r, table_g)]
    rows.append(("compute_score, 1 process", num / sec, ours, table))

    (pool, _), start_s = timed(lambda: (p := RewardPool(2, timeout_s=5.0), p.wait_until_ready()))
    with pool:
        cpu = time.process_time()
        pooled, sec = timed(lambda: [x["acc"] for x in pool.score(responses, truths)])
        notes.append(f"RewardPool parent (dispatch, IPC): {time.process_time() - cpu:.2f} CPU s")
        table = [x["acc"] for x in pool.score(table_r, table_g)]
    rows.append((f"RewardPool(2) (+{start_s:.1f} s start)", num / sec, pooled, table))

    base, sec = timed(lambda: [raw_math_verify(r, g) for r, g in zip(responses, truths[:baseline_num])])
    table = [raw_math_verify(r, g) for r, g in zip(table_r, table_g)]
    rows.append(("raw math-verify (baseline)", baseline_num / sec, base, table))

    base_rate = rows[-1][1]
    print(f"{'scorer':34s} {'resp/s':>10s} {'vs base':>9s} {'synthetic acc':>14s}  labelled table")
    for name, rate, accs, table in rows:
        agree = sum(a == e for a, e in zip(accs, labels)) / len(accs)
        print(f"{name:34s} {rate:10.1f} {rate / base_rate:8.0f}x {agree:14.1%}  {table_accuracy(table)}")
    print("; ".join(notes))


if __name__ == "__main__":
    main()
