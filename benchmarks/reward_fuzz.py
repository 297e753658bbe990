"""Adversarial fuzzing of the reward scorers: no exception, bounded time, no false positive.

Generates N inputs from a seed. Most are WRONG BY CONSTRUCTION: the final "Answer:" line, which
ends the response, asserts nothing about the ground truth `a` (a box with a hedge around it, "at
least a", "not a"), or asserts another value (b != a in any accepted form, lists "a, b", towers
such as 9^{9^{9^9}} against a small `a`, long digit strings, b with unicode noise, an earlier
"Answer: a" followed by a last "Answer: b"). Before that line comes chain-of-thought noise of up
to ~60k characters: prose, LaTeX commands, nested and unbalanced braces, \\boxed, huge powers,
long digit runs, unicode minus signs, spaces and lone surrogates (never the word "answer").
Some inputs are pure noise ("random" kind: "Answer:" anywhere, odd ground truths), checked only
for exceptions and time, and some are controls: plainly correct answers that must score +1 (a
harness that scored everything -1 would otherwise pass).

Each input is scored inline by our scorer (reward.compute_score) and the paper's rule
(reward.paper_rule.compute_score), and every --pool-every-th input also through a
RewardPool holding both, whose results must equal the inline ones. The report gives the counts,
the worst inline call (seconds and kind) and the throughput. The exit status is 1 on any
exception, false positive of ours, inline call over --max-call-s, pool mismatch or rejected
control. The paper rule's false positives are printed, not counted: they are its documented
behaviour (it keeps the text after the last "=" and the first $...$ pair, so "at least x = 42"
and "$42$ is wrong" read as 42).

    python benchmarks/reward_fuzz.py [--n 14000] [--seed 0] [--pool-every 10]

``run(quick)`` (benchmarks/run_all.py) gives the same counts as figures, for 1,000 inputs (quick)
or the defaults.

Imports nothing from tests/ (house rule): its data lives here.
"""

import argparse
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: the package

from megatron_dapo.reward import RewardPool, compute_score, paper_rule
from megatron_dapo.reward.math_dapo import warm_up

SCORERS = {"ours": compute_score, "paper": paper_rule.compute_score}

# Hedges: with any of these next to it, a value is not asserted. ARITH ones change the value
# (so they need |a| >= 3: "-0" is 0, "1 squared" is 1, "2!" is 2).
HEDGE_BEFORE = [
    "at least", "at most", "more than", "less than", "fewer than", "greater than", "no more than",
    "no less than", "not", "not exactly", "anything but", "except", "everything except", "all but",
    "approximately", "about", "around", "roughly", "nearly", "almost", "close to", "up to", "under",
    "over", "above", "below", "between 1 and", "an upper bound is", "a lower bound is", "it is not",
    "the answer is not", "it could be", "it might be", "maybe", "perhaps", "possibly", "I guess",
    "my estimate is", "if n is even,", "unless n = 1,", "one possible value is",
    "a solution is", "at least x =", "if n =", "x \\neq", "x \\approx y =", "~", "\\approx", "\\geq",
    "\\leq", "\\ge", "\\le", "\\sim", "\\lesssim", ">", "<", ">=", "<=", "!=", "\u2248", "\u2265",
    "\u2264", "\\text{at least}", "\\textbf{NOT}", "\\mathrm{about}", "The final answer is not",
    "The answer is at least", "So the total is under", "It isn't", "It's not", "never",
]
HEDGE_AFTER = [
    "or more", "or less", "or fewer", "at most", "at least", "is false", "is wrong", "is incorrect",
    "is not the answer", "is not correct", "isn't right", "is an upper bound", "is a lower bound",
    "is an estimate", "(approximately)", "(approx.)", "roughly", "or so", "if x is positive",
    "if n is even", "when n > 2", "unless n = 0", "maybe", "?", "minimum", "maximum", "max",
    "tops", "at best", "is my guess", "is a guess", "is likely", "probably", "is possible",
    "is too small", "is too big", "is close", "or x", ", y", "and z", "or not", "+", "is not it",
    "(wrong)", "(not sure)", "is only a bound", "\\text{or more}", "\\textbf{(false)}", "of them",
    "< x", "> x", "\\le x", "\\pm x", "\\ne x", "\u00b1 x",
]
ARITH_BEFORE = ["-", "minus", "\u2212", "half of", "twice", "double", "the square of", "\\sqrt", "10^"]
ARITH_AFTER = ["!", "^2", "squared", "times two", "+ 1", "- 1", "thousand", "million", "\u00b2", "/ 2"]
HARMLESS_BEFORE = ["", "", "the answer is ", "So the total is ", "Therefore, the final answer is ", "we get "]
HARMLESS_AFTER = ["", "", ".", " is the answer", " is the number of ways."]
LABELS = ["Answer:", "Answer: ", "**Answer:** ", "ANSWER : ", "Final answer: ", "answer:\t", "Answer:\n"]
TRAILERS = ["", "", "\n", "\n\nThat completes the solution.", "\n\n\\end{document}", "  "]

# Noise for the chain of thought (no "answer", see _noise).
PROSE = [
    "We now consider the case where the sum is even.", "Hmm, wait, that is not right.",
    "So the number of arrangements is the product of the choices.", "Let me double-check.",
    "at least", "not", "the total is", "roughly", "thus", "therefore", "I think",
]
LATEX = [
    "$x^2 + 3x - 10 = 0$", "\\frac{a+b}{2}", "\\sqrt{", "\\boxed{", "\\boxed{17}", "}", "{", "}}}",
    "{{{", "\\left(", "\\right)", "\\[", "\\]", "$", "$$", "\\text{", "\\begin{align}", "&=", "\\\\",
    "9^{9^{9^9}}", "2^{1000}", "(10^{10})!", "\\binom{100}{50}", "\\fbox{", "\\dfrac{1}{3}",
    "\\(", "\\)", "\\approx", "\\geq", "\\,", "\\quad", "~", "x = 3", "=", "\\pm", "\\infty",
]
UNICODE = ["\u2212", "\u2013", "\u00a0", "\u2009", "\u200b", "\ufeff", "\u3000", "\ud800", "\udfff",
           "\u00b2", "\uff14", "\u0662", "\u00b0", "\u2248", "\U0001f600", "\u0301", "\u202e"]
MINUSES = ["\u2212", "\u2013", "\u2014", "\ufe63", "\uff0d"]
# Unicode noise that can be put anywhere in a number without making it another number.
INERT = ["\u200b", "\ufeff", "\u00a0", "\u2009", "\u3000", "\ud800", "\udfff", "\U0001f600", "\u202e",
         "\u0301"]


@dataclass(frozen=True)
class Case:
    response: str
    ground_truth: object
    kind: str
    expect: bool | None  # False: wrong by construction; True: a control; None: unchecked


def _value(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.5:
        return rng.randint(0, 999)
    if r < 0.7:
        return -rng.randint(1, 999)
    return rng.randint(-10**12, 10**12)


def _other(rng: random.Random, a: int) -> int:
    """A value b != a, often close to it."""
    digits = str(abs(a))
    candidates = [a + 1, a - 1, -a, 10 * a, a // 10, a + 10 ** rng.randint(1, 9), _value(rng),
                  int(digits[::-1]) * (1 if a >= 0 else -1), int(digits + str(rng.randint(0, 9)))]
    b = rng.choice(candidates)
    return b if b != a else a + 7


def _noise(rng: random.Random, length: int) -> str:
    """Chain-of-thought noise of about `length` characters, never containing "answer"."""
    parts, size = [], 0
    while size < length:
        r = rng.random()
        if r < 0.45:
            part = rng.choice(PROSE)
        elif r < 0.85:
            part = rng.choice(LATEX)
        elif r < 0.92:
            part = rng.choice(UNICODE) * rng.randint(1, 3)
        elif r < 0.97:
            part = str(rng.randint(0, 10 ** rng.randint(1, 40)))
        else:
            part = "\n\n"
        parts.append(part)
        size += len(part) + 1
    return " ".join(parts).replace("nswer", "nsw3r").replace("NSWER", "NSW3R")


def _body(rng: random.Random) -> str:
    """Noise before the final line: 70% up to 2k characters, 20% up to 20k, 10% up to 60k."""
    low, high = rng.choices([(0, 2000), (2000, 20_000), (20_000, 60_000)], weights=[7, 2, 1])[0]
    return _noise(rng, rng.randint(low, high)) + "\n\n"


def _form(rng: random.Random, b: int) -> str:
    """b written in one of the accepted forms (each reads as exactly b)."""
    return rng.choice([
        f"{b}", f"${b}$", f"\\boxed{{{b}}}", f"$\\boxed{{{b}}}$", f"{b}.", f"{b}.0", f"{b:,}", f"x = {b}",
        f"{b} degrees", f"$\\frac{{{2 * b}}}{{2}}$", f"\\boxed{{\\boxed{{{b}}}}}", f"\\text{{{b}}}",
        f"the answer is \\boxed{{{b}}}", f"$2^{{5}}+({b - 32})$", f"**{b}**", f"\\[{b}\\]", f"{b} units",
    ])


def _final(rng: random.Random, answer: str) -> str:
    return rng.choice(LABELS) + answer + rng.choice(TRAILERS)


def _wrap(rng: random.Random, a: int) -> str:
    return rng.choice([f"\\boxed{{{a}}}", f"$\\boxed{{{a}}}$", f"\\boxed{{\\boxed{{{a}}}}}", str(a),
                       f"${a}$"])


def gen_hedged(rng, a):
    """a (boxed or not) with a hedge before it, after it (40% each) or both (20%)."""
    arith = abs(a) >= 3 and rng.random() < 0.2
    before = rng.choice(ARITH_BEFORE if arith else HEDGE_BEFORE)
    after = rng.choice(ARITH_AFTER if arith else HEDGE_AFTER)
    r = rng.random()
    before, after = (before, "") if r < 0.4 else ("", after) if r < 0.8 else (before, after)
    if rng.random() < 0.2:
        before, after = before.upper(), after.upper()
    sep = rng.choice([" ", " ", "", "\\ ", "\\quad "]) if before else ""
    space = " " if after[:1].isalnum() else ""
    lead, tail = rng.choice(HARMLESS_BEFORE), rng.choice(HARMLESS_AFTER)
    return f"{lead}{before}{sep}{_wrap(rng, a)}{space}{after}{tail}"


def gen_other_value(rng, a):
    """b != a (often a +- 1, -a, 10a, a // 10, digits reversed) in an accepted form."""
    return _form(rng, _other(rng, a))


def gen_list(rng, a):
    """Two values, a and b != a, in either order: a list, alternatives, a tuple, a set, a +-."""
    b = _other(rng, a)
    x, y = rng.sample([a, b], 2)
    return rng.choice([
        f"{x}, {y}", f"{x} or {y}", f"({x}, {y})", f"{x} and {y}", f"\\{{{x}, {y}\\}}", f"{x}; {y}",
        f"\\boxed{{{x}}}, \\boxed{{{y}}}", f"\\boxed{{{x}}} or \\boxed{{{y}}}", f"{x} \\text{{ or }} {y}",
        f"{x} \\pm {abs(a - b)}",
    ])


def gen_huge(rng, a):
    """A value far from any |a| <= 10^12: towers, huge factorials and powers, long digit strings."""
    k, nines = rng.randint(2, 9), "9" * rng.randint(16, 30)
    tower = f"{k}^{{{k}^{{{k}^{{{k}}}}}}}"
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(30, 5000)))
    return rng.choice([
        f"${tower}$", f"\\boxed{{{tower}}}", "$(10^{10})!$", "$2^{2^{100}}$", f"$({k}^{{{k}^{{{k}}}}})!$",
        f"$10^{{{rng.randint(20, 9999)}}}$", "$\\binom{10^{6}}{5000}$", f"${nines}^{{999}}$",
        f"$\\frac{{1}}{{2}}^{{{tower}}}$", f"$\\sqrt{{{k}}}^{{{tower}}}$",
        f"{rng.randint(10**15, 10**16)}{digits}",
    ])


def gen_unicode(rng, a):
    """b != a with inert unicode inside, or -a (a > 0) written with a unicode minus sign."""
    if a > 0 and rng.random() < 0.3:
        return rng.choice(MINUSES) + str(a)
    text = _form(rng, _other(rng, a)) if rng.random() < 0.5 else str(_other(rng, a))
    for _ in range(rng.randint(1, 4)):
        i = rng.randint(0, len(text))
        text = text[:i] + rng.choice(INERT) + text[i:]
    return text


def gen_earlier_answer(rng, a):
    """a asserted first, or retracted; the last Answer line says b != a (or "a was wrong")."""
    b = _other(rng, a)
    return rng.choice([
        f"{a}\n" + _final(rng, _form(rng, b)),
        f"{_form(rng, b)} (Answer: {a} was wrong)",
        f"{_form(rng, b)}\nAnswer: not {a}",
        f"\\boxed{{{a}}} is wrong.\n\nAnswer: {_form(rng, b)}",
    ])


WRONG = [(gen_hedged, 0.40), (gen_other_value, 0.15), (gen_list, 0.10), (gen_huge, 0.08),
         (gen_unicode, 0.07), (gen_earlier_answer, 0.05)]


def _random_case(rng):
    """Pure noise with "Answer:" labels anywhere and odd ground truths: unchecked, must not raise."""
    text = _noise(rng, rng.choice([50, 500, 5000, 60_000]))
    for _ in range(rng.randint(0, 6)):
        i = rng.randint(0, len(text))
        label = rng.choice(LABELS + ["answer", "Answer", ":"]) + rng.choice(["", "42", "\\boxed{", "}"])
        text = text[:i] + label + text[i:]
    truth = rng.choice([str(_value(rng)), _value(rng), "1,000", "", "abc", "\\frac{1}{2}", "1e5", "-0",
                        "\ud800"])
    return Case(text, truth, "random", None)


def generate(n: int, seed: int = 0) -> list[Case]:
    """n cases: 85% wrong by construction, 10% unchecked noise, 5% controls (plainly correct)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        r = rng.random()
        if r < 0.10:
            cases.append(_random_case(rng))
            continue
        a = _value(rng)
        if r < 0.15:
            forms = [str(a), f"\\boxed{{{a}}}", f"$\\boxed{{{a}}}$", f"the answer is \\boxed{{{a}}}"]
            answer, kind, expect = rng.choice(forms), "control", True
        else:
            gen = rng.choices([g for g, _ in WRONG], weights=[w for _, w in WRONG])[0]
            answer, kind, expect = gen(rng, a), gen.__name__[4:], False
        truth = a if rng.random() < 0.1 else str(a)
        cases.append(Case(_body(rng) + _final(rng, answer), truth, kind, expect))
    return cases


class _CallTimeout(BaseException):
    """Raised by SIGALRM inside a call; a BaseException so that the scorers' `except Exception`
    does not swallow it."""


def _raise_timeout(signum, frame):
    raise _CallTimeout()


@dataclass
class Report:
    inputs: int = 0
    checked: int = 0
    exceptions: list = field(default_factory=list)
    false_positives: dict = field(default_factory=lambda: {name: [] for name in SCORERS})
    rejected_controls: list = field(default_factory=list)
    slow_calls: list = field(default_factory=list)
    pool_mismatches: list = field(default_factory=list)
    pool_items: int = 0
    pool_timeouts: int = 0
    worst_s: float = 0.0
    worst_kind: str = ""
    seconds: dict = field(default_factory=lambda: {name: 0.0 for name in SCORERS})
    pool_s: float = 0.0

    @property
    def failures(self) -> int:
        return (len(self.exceptions) + len(self.false_positives["ours"]) + len(self.rejected_controls)
                + len(self.slow_calls) + len(self.pool_mismatches))


def _timed_call(fn, case: Case, max_call_s: float, guard: bool):
    if guard:
        signal.setitimer(signal.ITIMER_REAL, max_call_s)
    start = time.perf_counter()
    try:
        return fn(case.response, case.ground_truth), time.perf_counter() - start
    finally:
        if guard:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _score_inline(cases, report, max_call_s, guard) -> dict:
    results = {name: [None] * len(cases) for name in SCORERS}
    for i, case in enumerate(cases):
        for name, fn in SCORERS.items():
            try:
                result, sec = _timed_call(fn, case, max_call_s, guard)
            except _CallTimeout:
                report.slow_calls.append((name, case.kind, f">{max_call_s}s", case.response[-200:]))
                continue
            except Exception as e:  # noqa: BLE001 - that is what we look for
                report.exceptions.append((name, case.kind, repr(e)[:200], case.response[-200:]))
                continue
            results[name][i] = result
            report.seconds[name] += sec
            if sec > report.worst_s:
                report.worst_s, report.worst_kind = sec, f"{name}/{case.kind}"
            if case.expect is False and result["acc"]:
                report.false_positives[name].append((case.kind, case.ground_truth, case.response[-200:]))
            if name == "ours" and case.expect is True and not result["acc"]:
                report.rejected_controls.append((case.ground_truth, case.response[-200:]))
    return results


def _score_pool(cases, inline, report, pool_every, num_workers) -> None:
    subset = list(range(0, len(cases), pool_every))
    responses = [cases[i].response for i in subset]
    # RewardPool takes str ground truths, as the trainer and eval pass them (an int raises TypeError).
    truths = [str(cases[i].ground_truth) for i in subset]
    start = time.perf_counter()
    with RewardPool(num_workers, timeout_s=10.0, score_fns={"paper": paper_rule.compute_score}) as pool:
        for name, fn_name in (("ours", None), ("paper", "paper")):
            try:
                got = pool.score(responses, truths, fn=fn_name)
            except Exception as e:  # noqa: BLE001
                report.exceptions.append((f"pool/{name}", "-", repr(e)[:200], ""))
                continue
            report.pool_timeouts += sum(r["timed_out"] for r in got)
            for i, r in zip(subset, got):
                want, timed_out = inline[name][i], r.pop("timed_out")
                if want is not None and not timed_out and r != want:
                    report.pool_mismatches.append((name, cases[i].kind, r, want))
    report.pool_items, report.pool_s = 2 * len(subset), time.perf_counter() - start


def check(cases: list[Case], pool_every: int = 10, max_call_s: float = 5.0, num_workers: int = 2) -> Report:
    """Scores every case inline with both scorers (and every pool_every-th through a RewardPool;
    0: none) and returns what went wrong.

    A call over max_call_s is interrupted by SIGALRM, except off the main thread or while another
    timer is armed (e.g. pytest-timeout's, which then bounds the run): it would be cancelled.
    """
    warm_up()
    report = Report(inputs=len(cases), checked=sum(c.expect is not None for c in cases))
    on_main = threading.current_thread() is threading.main_thread()
    guard = on_main and not signal.getitimer(signal.ITIMER_REAL)[0]
    old = signal.signal(signal.SIGALRM, _raise_timeout) if guard else None
    try:
        inline = _score_inline(cases, report, max_call_s, guard)
    finally:
        if guard:
            signal.signal(signal.SIGALRM, old)
    if pool_every:
        _score_pool(cases, inline, report, pool_every, num_workers)
    return report


def print_report(report: Report, gen_s: float) -> None:
    n, fps = report.inputs, report.false_positives
    print(f"inputs {n} ({report.checked} checked: wrong by construction or controls), "
          f"generated in {gen_s:.1f} s")
    print(f"exceptions {len(report.exceptions)}; false positives: ours {len(fps['ours'])}, paper rule "
          f"{len(fps['paper'])} (informational); rejected controls {len(report.rejected_controls)}; "
          f"calls over the limit {len(report.slow_calls)}")
    rates = ", ".join(f"{name} {n / max(s, 1e-9):,.0f}/s" for name, s in report.seconds.items())
    print(f"worst inline call {report.worst_s:.3f} s ({report.worst_kind}); inline throughput {rates}")
    if report.pool_items:
        print(f"RewardPool: {report.pool_items} items at {report.pool_items / report.pool_s:,.0f}/s incl. "
              f"start, {report.pool_timeouts} timeouts, {len(report.pool_mismatches)} mismatches")
    shown = [("exception", report.exceptions), ("false positive (ours)", fps["ours"]),
             ("false positive (paper rule)", fps["paper"][:3]),
             ("rejected control", report.rejected_controls), ("slow call", report.slow_calls),
             ("pool mismatch", report.pool_mismatches)]
    for title, rows in shown:
        for row in rows[:10]:
            print(f"  {title}: {row!r}"[:400])


QUICK = dict(n=1000, seed=0, pool_every=10, max_call_s=5.0, workers=2)
FULL = dict(n=14_000, seed=0, pool_every=10, max_call_s=5.0, workers=2)


def measure(n: int, seed: int, pool_every: int, max_call_s: float, workers: int) -> tuple[Report, float]:
    """(the report, seconds spent generating the inputs)."""
    start = time.perf_counter()
    cases = generate(n, seed)
    gen_s = time.perf_counter() - start
    return check(cases, pool_every, max_call_s, workers), gen_s


def _rate(report: Report, name: str) -> float:
    return report.inputs / max(report.seconds[name], 1e-9)


def _figure(figure: str, value: float, unit: str, baseline_name: str | None = None,
            baseline: float | None = None, target: str | None = None, met: bool | None = None) -> dict:
    ratio = value / baseline if baseline else None  # none against a zero count
    return dict(figure=figure, value=float(value), unit=unit, baseline_name=baseline_name, baseline=baseline,
                ratio=ratio, target=target, met=met)


def figures(report: Report, max_call_s: float) -> list[dict]:
    """The exit status's criteria as figures (target 0, or the time limit), and the inline throughput
    of our scorer against the paper's rule on the same inputs. The paper rule's false positives are
    the baseline of ours: its documented behaviour, not a failure."""
    fps, paper = report.false_positives, "paper rule (reward.paper_rule)"
    out = [
        _figure("false positives of ours (wrong by construction, scored +1)", len(fps["ours"]), "inputs", paper,
                float(len(fps["paper"])), target="0", met=not fps["ours"]),
        _figure("exceptions (inline and pool, both scorers)", len(report.exceptions), "inputs", target="0",
                met=not report.exceptions),
        _figure("rejected controls (plainly correct, scored -1 by ours)", len(report.rejected_controls), "inputs",
                target="0", met=not report.rejected_controls),
        _figure(f"worst inline call ({report.worst_kind or '-'})", report.worst_s, "s",
                target=f"<= {max_call_s:g} s", met=report.worst_s <= max_call_s and not report.slow_calls),
        _figure("inline throughput, ours", _rate(report, "ours"), "inputs/s", paper, _rate(report, "paper")),
    ]
    if report.pool_items:
        out.append(_figure("RewardPool results differing from inline", len(report.pool_mismatches), "items",
                           target="0", met=not report.pool_mismatches))
    return out


def render_markdown(report: Report, size: dict, gen_s: float) -> str:
    fps = report.false_positives
    lines = [f"{report.inputs} inputs from seed {size['seed']} ({report.checked} checked: wrong by construction "
             f"or controls; generated in {gen_s:.1f} s); every {size['pool_every']}-th also through "
             f"RewardPool({size['workers']}); inline call limit {size['max_call_s']:g} s.", "",
             "| scorer | false positives | inputs/s inline | s inline (sum of calls) |", "|---|---|---|---|"]
    for name in SCORERS:
        lines.append(f"| {name} | {len(fps[name])} | {_rate(report, name):,.0f} | {report.seconds[name]:.1f} |")
    lines += ["", f"Exceptions {len(report.exceptions)}, rejected controls {len(report.rejected_controls)}, calls "
                  f"over the limit {len(report.slow_calls)}, worst inline call {report.worst_s:.3f} s "
                  f"({report.worst_kind or '-'})."]
    if report.pool_items:
        lines.append(f"RewardPool: {report.pool_items} items at {report.pool_items / report.pool_s:,.0f}/s incl. "
                     f"start, {report.pool_timeouts} timeouts, {len(report.pool_mismatches)} mismatches.")
    return "\n".join(lines) + "\n"


def _details(report: Report, size: dict, gen_s: float) -> dict:
    """Counts only: the offending inputs hold lone surrogates, which no UTF-8 file can take."""
    return dict(size, generate_s=gen_s, inputs=report.inputs, checked=report.checked,
                exceptions=len(report.exceptions), rejected_controls=len(report.rejected_controls),
                false_positives={k: len(v) for k, v in report.false_positives.items()},
                slow_calls=len(report.slow_calls), worst_s=report.worst_s, worst_kind=report.worst_kind,
                seconds=report.seconds, pool_items=report.pool_items, pool_s=report.pool_s,
                pool_timeouts=report.pool_timeouts, pool_mismatches=len(report.pool_mismatches),
                failures=report.failures)


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (1,000 inputs, well under a minute) or FULL (the CLI's
    defaults: 14,000 inputs)."""
    size = QUICK if quick else FULL
    report, gen_s = measure(**size)
    return dict(name="reward_fuzz", figures=figures(report, size["max_call_s"]),
                markdown=render_markdown(report, size, gen_s), details=_details(report, size, gen_s))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=FULL["n"], help="number of inputs")
    parser.add_argument("--seed", type=int, default=FULL["seed"])
    parser.add_argument("--pool-every", type=int, default=FULL["pool_every"],
                        help="score every k-th input through RewardPool too (0: none)")
    parser.add_argument("--workers", type=int, default=FULL["workers"], help="RewardPool workers")
    parser.add_argument("--max-call-s", type=float, default=FULL["max_call_s"],
                        help="an inline call longer than this fails")
    args = parser.parse_args()
    report, gen_s = measure(args.n, args.seed, args.pool_every, args.max_call_s, args.workers)
    print_report(report, gen_s)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
