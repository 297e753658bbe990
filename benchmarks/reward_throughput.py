"""Reward throughput and accuracy: our DAPO-Math scorer before and after exact_forms, and raw math-verify.

Builds N synthetic responses of about 16k tokens (60-70k characters of chain-of-thought filler:
prose and LaTeX, ending in an "Answer:" line in one of 11 forms, half correct). In one process it
times, alternately and `repeats` times each (the median is reported, so both see the same load):
  (a) compute_score as it is: expressions evaluated by reward/exact_forms.py, sympy for the rest;
  (b) the same with sympy_only=True: every expression through math-verify's parse, uncached (the
      scorer before exact_forms; the baseline of the target of >= 1000 responses/s).
Per answer form it gives the mean time of each, so the table shows where the time goes. The full
run adds (c) RewardPool with 2 worker processes (startup timed separately) and (d) the baseline
verify(parse(gt), parse(full_text)) with math-verify's own 5 s timeouts on at most --baseline-num
responses. It also reports the accuracy of each on the labelled table in
megatron_dapo/reward/labelled_cases.py. Some labels there are format policy, not math (a correct
\\boxed{} without an "Answer:" line is wrong), so raw math-verify's "false positives" include such
rows; the sympy-only path's are real (rows "exact: 2(3) vs 5" and after).
If the load average exceeds the CPU count, the pool's workers share cores with other processes,
and its rate says little about its scaling.

    python benchmarks/reward_throughput.py [--num 512] [--quick] [--baseline-num 128] [--repeats 3]
"""

import argparse
import os
import random
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: the package from a checkout

from megatron_dapo.reward import RewardPool, compute_score, math_dapo
from megatron_dapo.reward.labelled_cases import CASES

TARGET_RATE = 1000.0  # responses/s, one process: a default generation batch (1,536 x 16) in under 25 s
QUICK = {"num": 64, "baseline_num": 8, "repeats": 3, "pool": False, "raw_table": False}
FULL = {"num": 512, "baseline_num": 128, "repeats": 3, "pool": True, "raw_table": True}

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
    # The two expressions: exact_forms.py now, math-verify's parse (2-5 ms each) before.
    "Answer: $\\sqrt{{{sq}}}$", "Answer: ${p8} - 2^{{3}}$",
]


def make_responses(num: int, seed: int = 0) -> tuple[list[str], list[str], list[bool], list[int]]:
    """(responses, ground truths, whether each is correct, index of its answer form in FORMS)."""
    rng = random.Random(seed)
    responses, truths, labels, forms = [], [], [], []
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
        form = rng.randrange(len(FORMS))
        answer = FORMS[form].format(v=value, w=2 * value, sq=value * value, p8=value + 8)
        responses.append(" ".join(parts) + "\n\n" + answer)
        truths.append(str(truth))
        labels.append(correct)
        forms.append(form)
    return responses, truths, labels, forms


def raw_math_verify(response: str, ground_truth: str) -> bool:
    from math_verify import parse, verify

    return verify(parse(f"${ground_truth}$"), parse(response))  # default 5 s signal timeouts


def time_scorer(score, responses, truths, forms) -> dict:
    """One pass: responses/s, the acc of each response, and seconds per answer form."""
    _clear_caches()
    accs, form_s = [], [0.0] * len(FORMS)
    start = time.perf_counter()
    for response, truth, form in zip(responses, truths, forms):
        t = time.perf_counter()
        accs.append(score(response, truth)["acc"])
        form_s[form] += time.perf_counter() - t
    return {"rate": len(responses) / (time.perf_counter() - start), "accs": accs, "form_s": form_s}


def _clear_caches() -> None:
    """Each pass starts cold: the passes repeat the same answers, which no cache may carry over."""
    import sympy
    from math_verify import parser

    math_dapo._expression_value.cache_clear()
    parser.parse_latex_cached.cache_clear()  # math-verify's own, 20 entries: the quick mix fits in it
    sympy.core.cache.clear_cache()


def table_counts(accs: list[bool]) -> dict:
    expected = [c[2] for c in CASES]
    return {"right": sum(a == e for a, e in zip(accs, expected)), "rows": len(CASES),
            "fp": sum(a and not e for a, e in zip(accs, expected)),
            "fn": sum(e and not a for a, e in zip(accs, expected))}


def measure(num: int, baseline_num: int, repeats: int, pool: bool, raw_table: bool) -> dict:
    responses, truths, labels, forms = make_responses(num)
    table_r, table_g = [c[0] for c in CASES], [c[1] for c in CASES]
    result = {"num": num, "mean_chars": sum(map(len, responses)) / num, "cpus": os.cpu_count(),
              "load_before": os.getloadavg(), "form_counts": [forms.count(i) for i in range(len(FORMS))],
              "labels": labels, "rows": {}}
    math_dapo.warm_up()  # import math-verify outside the timed region
    scorers = {"after": compute_score, "before": partial(compute_score, sympy_only=True)}
    passes = {name: [] for name in scorers}
    cpu = time.process_time()
    for _ in range(repeats):  # alternate, so that both paths see the same load
        for name, score in scorers.items():
            passes[name].append(time_scorer(score, responses, truths, forms))
    result["scorer_cpu_s"] = time.process_time() - cpu
    for name, score in scorers.items():
        runs = sorted(passes[name], key=lambda p: p["rate"])
        median = runs[len(runs) // 2]
        table = table_counts([score(r, g)["acc"] for r, g in zip(table_r, table_g)])
        result["rows"][name] = dict(median, rates=[p["rate"] for p in passes[name]], table=table)
    if pool:
        start = time.perf_counter()
        with RewardPool(2, timeout_s=5.0) as reward_pool:
            reward_pool.wait_until_ready()
            start_s = time.perf_counter() - start
            start = time.perf_counter()
            accs = [x["acc"] for x in reward_pool.score(responses, truths)]
            rate = num / (time.perf_counter() - start)
            table = table_counts([x["acc"] for x in reward_pool.score(table_r, table_g)])
        result["rows"]["pool"] = {"rate": rate, "accs": accs, "table": table, "start_s": start_s}
    start = time.perf_counter()
    accs = [raw_math_verify(r, g) for r, g in zip(responses[:baseline_num], truths)]
    rate = baseline_num / (time.perf_counter() - start)
    # The table holds 100k-character garbage rows: about 20 s for raw math-verify.
    table = table_counts([raw_math_verify(r, g) for r, g in zip(table_r, table_g)]) if raw_table else None
    result["rows"]["raw"] = {"rate": rate, "accs": accs, "table": table}
    result["load_after"] = os.getloadavg()
    return result


def _agreement(accs: list[bool], labels: list[bool]) -> float:
    return sum(a == e for a, e in zip(accs, labels)) / len(accs)


def _figure(figure: str, value: float, unit: str, baseline_name: str | None = None,
            baseline: float | None = None, ratio: float | None = None, target: str | None = None,
            met: bool | None = None) -> dict:
    return {"figure": figure, "value": value, "unit": unit, "baseline_name": baseline_name,
            "baseline": baseline, "ratio": ratio, "target": target, "met": met}


def figures(result: dict) -> list[dict]:
    after, before, raw = (result["rows"][k] for k in ("after", "before", "raw"))
    ta, tb, labels = after["table"], before["table"], result["labels"]
    old = "sympy for every expression (before)"
    return [
        _figure("compute_score, 1 process, 16k-token mix", after["rate"], "responses/s", old, before["rate"],
                after["rate"] / before["rate"], f">= {TARGET_RATE:.0f} responses/s",
                after["rate"] >= TARGET_RATE),
        _figure("labelled table, rows right", float(ta["right"]), f"of {ta['rows']} rows", old,
                float(tb["right"]), ta["right"] / tb["right"], f"{ta['rows']}/{ta['rows']}",
                ta["right"] == ta["rows"]),
        _figure("labelled table, false positives", float(ta["fp"]), "rows", old, float(tb["fp"]),
                target="0", met=ta["fp"] == 0),
        _figure("synthetic mix, agreement with labels", _agreement(after["accs"], labels), "fraction", old,
                _agreement(before["accs"], labels), target="1.0", met=after["accs"] == labels),
        _figure("compute_score vs raw math-verify, 1 process", after["rate"], "responses/s",
                "raw math-verify verify(parse(gt), parse(full text))", raw["rate"],
                after["rate"] / raw["rate"]),
    ]


def _table_cell(t: dict | None) -> str:
    return "not run (quick)" if t is None else f"{t['right']}/{t['rows']} ({t['fp']} FP, {t['fn']} FN)"


def render_markdown(result: dict) -> str:
    rows, labels = result["rows"], result["labels"]
    load = ", ".join(f"{x:.1f}" for x in result["load_before"])
    names = {"after": "`compute_score`, 1 process", "before": "`compute_score(sympy_only=True)` (before)",
             "pool": f"`RewardPool(2)` (+{rows.get('pool', {}).get('start_s', 0):.1f} s start)",
             "raw": "raw math-verify `verify(parse(gt), parse(full_text))`"}
    lines = [(f"{result['num']} responses, mean {result['mean_chars']:,.0f} characters; "
              f"{result['cpus']} CPUs, load average {load} before; "
              f"scorer passes: {result['scorer_cpu_s']:.2f} CPU s."), "",
             "| scorer | responses/s | vs raw math-verify | synthetic acc | labelled table |",
             "|---|---|---|---|---|"]
    for key in ("after", "before", "pool", "raw"):
        if key in rows:
            r = rows[key]
            lines.append(f"| {names[key]} | {r['rate']:,.0f} | {r['rate'] / rows['raw']['rate']:,.0f}x | "
                         f"{_agreement(r['accs'], labels):.1%} | {_table_cell(r['table'])} |")
    after, before = rows["after"], rows["before"]
    lines += ["", (f"Median of {len(after['rates'])} alternating passes; after/before = "
                   f"{after['rate'] / before['rate']:,.1f}x. Where the time goes, per answer form "
                   "(mean per response):"), "",
              "| answer form | n | before us | before share | after us | after share |",
              "|---|---|---|---|---|---|"]
    total_b, total_a = sum(before["form_s"]), sum(after["form_s"])
    for i, form in enumerate(FORMS):
        n = result["form_counts"][i]
        if n:
            shown = form.format(v=1042, w=2084, sq=1042**2, p8=1050).replace("\n", "\\n").replace("|", "\\|")
            lines.append(f"| `{shown}` | {n} | {before['form_s'][i] / n * 1e6:,.0f} | "
                         f"{before['form_s'][i] / total_b:.1%} | {after['form_s'][i] / n * 1e6:,.1f} | "
                         f"{after['form_s'][i] / total_a:.1%} |")
    return "\n".join(lines) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (64 responses, no pool, a few seconds) or FULL (512, pool)."""
    result = measure(**(QUICK if quick else FULL))
    details = {k: v for k, v in result.items() if k != "labels"}
    details["rows"] = {name: {k: v for k, v in row.items() if k != "accs"}
                       for name, row in result["rows"].items()}
    return {"name": "reward", "figures": figures(result), "markdown": render_markdown(result),
            "details": details}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=FULL["num"], help="number of synthetic responses")
    parser.add_argument("--quick", action="store_true", help="64 responses, 8 for raw math-verify, no pool")
    parser.add_argument("--baseline-num", type=int, default=FULL["baseline_num"],
                        help="cap for raw math-verify")
    parser.add_argument("--repeats", type=int, default=FULL["repeats"], help="alternating passes per path")
    args = parser.parse_args()
    size = dict(QUICK)
    if not args.quick:
        size = dict(FULL, num=args.num, baseline_num=min(args.num, args.baseline_num), repeats=args.repeats)
    result = measure(**size)
    print(render_markdown(result))
    for fig in figures(result):
        met = "" if fig["met"] is None else ("  met" if fig["met"] else "  NOT MET")
        print(f"{fig['figure']}: {fig['value']:,.3g} {fig['unit']} (baseline {fig['baseline']:,.3g}){met}")


if __name__ == "__main__":
    main()
