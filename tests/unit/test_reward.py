"""DAPO-Math scorer (labelled table + zero-false-positive properties) and RewardPool behaviour."""

import os
import threading
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import REWARD_FNS, RewardPool, compute_score, get_reward_fn
from megatron_dapo.reward.math_dapo import TAIL_CHARS
from megatron_dapo.reward.labelled_cases import CASES, HARMLESS_AFTER, HARMLESS_BEFORE, HEDGE_AFTER, HEDGE_BEFORE

POOL_TIMEOUT_S = 2.0
# A hung item is abandoned at the limit, never waited for: bounds in these tests are half the hang,
# not timings (a replacement worker's start takes seconds on a loaded 2-core box, never a minute).
HANG_S = 60.0
ABANDONED_S = HANG_S / 2
TOWER = "Answer: $9^{9^{9^{9}}}$"  # parses instantly; sympy then never finishes comparing it


def _hooked_score(response: str, ground_truth: str) -> dict:
    """Test hook: compute_score, except that "SLEEP" hangs far past any timeout, "NAP..." takes
    50 ms, and "CRASH" kills the worker process (like the OOM killer would)."""
    if response == "SLEEP":
        time.sleep(HANG_S)
    if response.startswith("NAP"):
        time.sleep(0.05)
    if response == "CRASH":
        os._exit(3)
    return compute_score(response, ground_truth)


def _raw_math_verify_score(response: str, ground_truth: str) -> dict:
    """Test hook: math-verify on the raw text with no guards, to get a real sympy hang."""
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$", parsing_timeout=None)
    ok = verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None)
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": ""}


def _strip_flag(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "timed_out"}


# ---------------------------------------------------------------- compute_score


@pytest.mark.parametrize("response,ground_truth,expected,label", CASES, ids=[c[3] for c in CASES])
def test_labelled_cases(response, ground_truth, expected, label):
    result = compute_score(response, ground_truth)
    assert result["acc"] is expected, f"{label}: pred={result['pred']!r}"
    assert result["score"] == (1.0 if expected else -1.0)
    assert isinstance(result["pred"], str)


# Every class of answer that math_dapo's docstring says is rejected, by labels of rows in CASES.
REJECTION_CLASSES = {
    "lists": ["list with space", "two assignments", "tuple", "set"],
    "hedges": ["two answers", "boxed and hedge", "negated", "tilde means about"],
    "relations other than =": ["inequality", "ascii inequality", "approximately",
                               "relation command before assignment"],
    "words that are not known units": ["scale word", "variable", "hedge before assignment",
                                       "conditional assignment", "hedge inside the box",
                                       "capitals hedge before assignment",
                                       "capitals with a negation before assignment"],
    "decimals inside expressions": ["decimal inside expression"],
    "several different boxed answers": ["two boxed"],
    "unbalanced LaTeX": ["unbalanced box", "unbalanced frac", "deep unbalanced"],
    "non-ASCII leftovers": ["unicode superscript", "arabic-indic digit", "fullwidth digits"],
    "prose around a box off the allowlist": [c[3] for c in CASES if c[3].startswith("boxed prose hedge")],
    "juxtaposed rational factors": ["exact: juxtaposed numbers are ambiguous", "exact: (2)(3) vs 5",
                                    "exact: 2(3) vs 5 (math-verify: mixed number)", "exact: frac(4) vs 7",
                                    "exact: 2 sqrt2 sqrt2 vs 4"],
    "a/b c": ["exact: a/b c vs a/(b c)"],
    "division by zero": ["exact: division by zero"],
    "values over exact_forms.MAX_BITS bits": ["exact: value over MAX_BITS bits"],
}


def _first_box(text: str) -> str:
    """The first outermost \\boxed{...} in text (balanced braces)."""
    start = text.index("\\boxed{")
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start: i + 1]
    raise ValueError(text)


def test_table_covers_every_rejection_class():
    rows = {c[3]: c for c in CASES}
    assert len(CASES) >= 60 and sum(c[2] for c in CASES) >= 30 and sum(not c[2] for c in CASES) >= 30
    for name, labels in REJECTION_CLASSES.items():
        assert labels, name
        for label in labels:
            response, truth, expected, _ = rows[label]
            assert expected is False and not compute_score(response, truth)["acc"], (name, label)


@pytest.mark.parametrize("accepted", [True, False])
def test_boxed_prose_rows_differ_only_by_their_prose(accepted):
    """Both kinds of boxed-prose rows exist, and each row's box alone is correct: a hedged row is
    rejected for its prose, and a harmless row scores as its box."""
    prefix = "boxed prose ok" if accepted else "boxed prose hedge"
    rows = [c for c in CASES if c[3].startswith(prefix)]
    assert len(rows) >= 10 and all(c[2] is accepted for c in rows)
    for response, truth, _, label in rows:
        assert compute_score(f"Answer: {_first_box(response)}", truth)["acc"], label
        assert compute_score(response, truth)["acc"] is accepted, label


def test_pred_is_normalised_answer():
    assert compute_score("Answer: $\\boxed{1{,}000}$.", "1000")["pred"] == "1000"
    assert compute_score("no label here", "1")["pred"] == ""


@pytest.mark.parametrize("bad", [None, 42.5, b"Answer: 42", ["Answer: 42"], "\ud800", "", "4\x002"])
def test_never_raises(bad):
    for result in (compute_score(bad, "42"), compute_score("Answer: 42", bad)):
        assert result["acc"] is False and result["score"] == -1.0


def test_only_tail_is_read():
    answer = "Answer: 42\n"
    assert compute_score(answer + "x" * (TAIL_CHARS - len(answer) - 1), "42")["acc"]
    assert not compute_score(answer + "x" * TAIL_CHARS, "42")["acc"]


def _render(value: int, form: int) -> str:
    """`value` written in one of the accepted answer forms, after some chain of thought."""
    text = [
        f"{value}", f"${value}$", f"\\boxed{{{value}}}", f"\\({value}\\)", f"\\[{value}\\]",
        f"{value}.", f"{value}.0", f"{value:,}", f"x = {value}", f"{value} degrees", f"{value} cm",
        f"${value}^\\circ$", f"\\${value}", f"{value}\\%", f"$\\text{{{value}}}$",
        f"$\\textbf{{{value}}}$", str(value).replace("-", "\u2212"), f"$\\frac{{{2 * value}}}{{2}}$",
        f"{3 * value}/3", f"$\\dfrac{{{-value}}}{{-1}}$", f"$2^{{5}}+({value - 32})$",
        f"$\\boxed{{{value}}}$ units", f"$\\sqrt{{{value * value}}}$" if value >= 0 else f"{value}",
    ][form]
    label = "**Answer:**" if form % 3 == 0 else "Answer:"
    return f"So the computation gives the result below.\n\n{label} {text}"


NUM_FORMS = 23
_other = st.one_of(
    st.integers(-10**7, 10**7),
    st.sampled_from(["times10", "div10", "plus1", "minus1", "neg", "digits"]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(-10**7, 10**7), form=st.integers(0, NUM_FORMS - 1), other=_other)
def test_no_false_positives(a, form, other):
    near = {"times10": a * 10, "div10": a // 10, "plus1": a + 1, "minus1": a - 1, "neg": -a,
            "digits": int(str(abs(a))[::-1]) * (1 if a >= 0 else -1)}
    b = near.get(other, other)
    assume(a != b)
    response = _render(a, form)
    assert compute_score(response, str(a))["acc"], f"form {form} not accepted: {response!r}"
    assert not compute_score(response, str(b))["acc"], f"{response!r} scored as {b}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(-10**7, 10**7), before=st.sampled_from([""] + HEDGE_BEFORE),
       after=st.sampled_from([""] + HEDGE_AFTER), lead=st.sampled_from(HARMLESS_BEFORE),
       dollars=st.booleans(), upper=st.booleans())
def test_hedged_box_is_never_correct(a, before, after, lead, dollars, upper):
    assume(before or after)
    box = f"$\\boxed{{{a}}}$" if dollars else f"\\boxed{{{a}}}"
    prose = f"{lead}{before}{box}{after}"
    response = f"So the computation gives the result below.\n\nAnswer: {prose.upper() if upper else prose}"
    assert not compute_score(response, str(a))["acc"], f"{response!r} scored as {a}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(-10**7, 10**7), depth=st.integers(1, 4),
       pads=st.lists(st.sampled_from(["", " "]), min_size=4, max_size=4), fbox=st.booleans(),
       before=st.sampled_from(HARMLESS_BEFORE), after=st.sampled_from(HARMLESS_AFTER), dollars=st.booleans())
def test_nested_boxes_read_as_their_content(a, depth, pads, fbox, before, after, dollars):
    box = str(a)
    for level in range(depth):
        command = "\\fbox" if fbox and level == 0 else "\\boxed"
        box = f"{command}{{{pads[level]}{box}{pads[level]}}}"
    box = f"${box}$" if dollars else box
    response = f"So the computation gives the result below.\n\nAnswer: {before}{box}{after}"
    assert compute_score(response, str(a))["acc"], f"{response!r} not read as {a}"
    assert not compute_score(response, str(a + 1))["acc"]


# ---------------------------------------------------------------- registry


def test_registry():
    assert get_reward_fn("dapo_math") is compute_score
    with pytest.raises(ValueError, match=r"valid names: \['dapo_math', 'math_dapo_paper'\]"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        REWARD_FNS.register("dapo_math")(len)


# ---------------------------------------------------------------- RewardPool


def _batch(n: int) -> tuple[list[str], list[str]]:
    rows = [CASES[i % len(CASES)] for i in range(n)]
    return [r[0] for r in rows], [r[1] for r in rows]


@pytest.fixture(scope="module")
def hooked_pool():
    with RewardPool(num_workers=2, timeout_s=POOL_TIMEOUT_S, score_fn=_hooked_score) as pool:
        pool.wait_until_ready()
        yield pool


def test_pool_matches_inline_and_keeps_order(hooked_pool):
    responses, truths = _batch(200)
    results = hooked_pool.score(responses, truths)
    assert [i for i, r in enumerate(results) if r["timed_out"]] == []
    assert [_strip_flag(r) for r in results] == [compute_score(r, t) for r, t in zip(responses, truths)]
    assert hooked_pool.last_num_timeouts == 0


def test_pool_inline_mode():
    responses, truths = _batch(30)
    with RewardPool(num_workers=0, timeout_s=1.0) as pool:
        results = pool.score(responses, truths)
    assert [_strip_flag(r) for r in results] == [compute_score(r, t) for r, t in zip(responses, truths)]


def test_pool_times_out_only_the_hanging_item_and_recovers(hooked_pool):
    before = hooked_pool.num_timeouts
    responses = ["Answer: 1"] * 20 + ["SLEEP"] + ["Answer: 2"] * 20
    start = time.monotonic()
    results = hooked_pool.score(responses, ["1"] * 20 + ["1"] + ["2"] * 20)
    assert time.monotonic() - start < ABANDONED_S
    assert results[20] == {"score": -1.0, "acc": False, "pred": "", "timed_out": True}
    assert all(r["acc"] and not r["timed_out"] for i, r in enumerate(results) if i != 20)
    assert hooked_pool.last_num_timeouts == 1 and hooked_pool.num_timeouts == before + 1
    # The killed worker was replaced (white-box check), and the next batch is scored normally.
    assert sum(w.process.is_alive() for w in hooked_pool._workers) == 2
    responses, truths = _batch(100)
    results = hooked_pool.score(responses, truths)
    assert [r["acc"] for r in results] == [c[2] for c in (CASES * 2)[:100]]
    assert hooked_pool.last_num_timeouts == 0 and hooked_pool.num_timeouts == before + 1


def test_pool_from_a_thread(hooked_pool):
    responses, truths = _batch(50)
    out = {}
    thread = threading.Thread(target=lambda: out.update(results=hooked_pool.score(responses, truths)))
    thread.start()
    thread.join(timeout=60)
    assert [r["acc"] for r in out["results"]] == [c[2] for c in CASES[:50]]


def test_pool_timeout_with_large_unpipelined_chunks():
    # Untruncated 150k-character responses: two do not fit in a socket buffer. Once the NAP item
    # is answered, the worker stuck on SLEEP has room in its queue; sending it the next chunk
    # would block the parent (until the minute's sleep ends) instead of enforcing the timeout.
    # Distinct strings: pickle would send repeated ones only once.
    responses = [f"{i}" + "x" * 150_000 + "\nAnswer: 7" for i in range(16)]
    responses[4], responses[5] = "NAP" + responses[4], "SLEEP"
    timeout_s = 1.0  # long enough for NAP, short to keep the test fast
    with RewardPool(1, timeout_s, _hooked_score, max_response_chars=None, chunk_size=4) as pool:
        pool.wait_until_ready()
        start = time.monotonic()
        results = pool.score(responses, ["7"] * len(responses))
        # One worker: items after the hang also wait for its replacement to start.
        assert time.monotonic() - start < ABANDONED_S
    assert [r["timed_out"] for r in results] == [i == 5 for i in range(16)]
    assert [r["acc"] for r in results] == [i != 5 for i in range(16)]


def test_pool_survives_a_dying_worker(hooked_pool):
    before = (hooked_pool.num_crashes, hooked_pool.num_timeouts)
    responses = ["Answer: 1"] * 10 + ["CRASH"] + ["Answer: 3"] * 10
    results = hooked_pool.score(responses, ["1"] * 11 + ["3"] * 10)
    assert [r["acc"] for r in results] == [i != 10 for i in range(21)]
    assert not any(r["timed_out"] for r in results)
    assert (hooked_pool.num_crashes, hooked_pool.num_timeouts) == (before[0] + 1, before[1])


def test_workers_outlive_the_stop_signals_a_job_step_sends_to_every_process():
    """SLURM's --signal=USR1 and time-limit TERM (and Ctrl-C) reach every process of the step, the
    reward workers included; a worker killed by one would score its item as failed and change the
    step's groups (tests/functional/test_slurm.py caught that). Stopping is the trainer's call."""
    import os
    import signal

    def signal_all(pool):
        for pid in [w.process.pid for w in pool._workers]:
            for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
                os.kill(pid, sig)

    responses, truths = _batch(50)
    with RewardPool(num_workers=1, timeout_s=POOL_TIMEOUT_S, score_fn=_hooked_score) as pool:
        pid = pool._workers[0].process.pid
        pool.wait_until_ready()
        signal_all(pool)
        time.sleep(0.3)
        results = pool.score(responses, truths)
        assert [r["acc"] for r in results] == [c[2] for c in CASES[:50]]
        assert pool._workers[0].process.pid == pid and pool.num_crashes == 0


def test_pool_bounds_a_real_sympy_hang():
    timeout_s = 1.0
    with RewardPool(num_workers=1, timeout_s=timeout_s, score_fn=_raw_math_verify_score) as pool:
        pool.wait_until_ready()
        start = time.monotonic()
        # The hang comes last: with one worker, later items would wait for its replacement.
        results = pool.score(["Answer: $41$", "Answer: $42$", TOWER], ["42", "42", "42"])
        assert time.monotonic() - start < ABANDONED_S
        assert [r["timed_out"] for r in results] == [False, False, True]
        assert [r["acc"] for r in results] == [False, True, False]


def test_guard_rejects_tower_without_sympy():
    start = time.monotonic()
    assert not compute_score(TOWER, "42")["acc"]
    assert time.monotonic() - start < 5.0  # microseconds guarded; sympy would never return


def test_pool_rejects_mismatched_lengths_and_use_after_close():
    pool = RewardPool(num_workers=0, timeout_s=1.0)
    with pytest.raises(ValueError):
        pool.score(["a"], [])
    pool.close()
    with pytest.raises(RuntimeError):
        pool.score([], [])
