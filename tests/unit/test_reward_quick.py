"""The scorers' quick companions (reward.QUICK_FNS) and RewardPool's inline pass: a quick result is
the full scorer's result, math-verify is never reached inline, and what only the full scorer can
decide still runs in a worker under the time limit."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import QUICK_FNS, REWARD_FNS, RewardPool, compute_score, math_dapo, paper_rule
from megatron_dapo.reward.labelled_cases import CASES, SCORER_CASES
from tests.helpers.verl_reference import verl

TIMEOUT_S = 2.0
HANG_S = 60.0  # far past the limit: a pool that waited for the hung item would take this long
# Needs math-verify: exact_forms leaves an unbraced argument to it (Undecided).
SYMPY_ONLY = ("Answer: $\\sqrt4$", "2")


def _corpus():
    rows = [(r, g) for r, g, *_ in CASES] + [(c[0], c[1]) for c in SCORER_CASES]
    return rows + [(f"so the largest is 7\nAnswer: {d}", "7") for d in range(10)] + [SYMPY_ONLY]


def test_quick_score_is_compute_score_or_none(monkeypatch):
    """On every labelled case: the same dict as the full scorer, or None; and sympy never runs."""
    rows = _corpus()
    full = [compute_score(r, g) for r, g in rows]

    def no_sympy(expr):
        raise AssertionError(f"quick_score reached math-verify on {expr!r}")

    monkeypatch.setattr(math_dapo, "_sympy_value", no_sympy)
    quick = [math_dapo.quick_score(r, g) for r, g in rows]
    assert [q for q, f in zip(quick, full) if q is not None and q != f] == []
    decided = sum(q is not None for q in quick)
    assert decided >= 0.9 * len(rows), f"quick_score decided only {decided} of {len(rows)}"
    assert quick[-1] is None and full[-1]["acc"]  # the sympy-only case is left to the worker
    assert quick[-4] == full[-4] == {"score": 1.0, "acc": True, "pred": "7"}


@pytest.mark.parametrize("name", sorted(QUICK_FNS))
def test_quick_fns_match_their_scorers(name):
    full, quick = REWARD_FNS.get(name), QUICK_FNS[name]
    rows = _corpus()
    assert [(r, g) for r, g in rows if quick(r, g) not in (None, full(r, g))] == []


@settings(deadline=None)  # the first example imports verl
@given(st.text(alphabet=" \t\u00a00123456789\u0663", max_size=12))
def test_paper_rule_digit_fast_path(text):
    """The fast path returns what the paper's normalisation returns, as verl 0.9.1 ships it (the
    independent reference), and what every one of our steps returns; non-ASCII digits (U+0663)
    must not take it."""
    verl_normalize = verl()[1].normalize_final_answer
    assert paper_rule.normalize_final_answer(text) == verl_normalize(text) == paper_rule.normalize_steps(text)


def _hang_on_sleep(response: str, ground_truth: str) -> dict:
    """Worker-side scorer of the pool test: "SLEEP" hangs past the time limit."""
    if response == "SLEEP":
        time.sleep(HANG_S)
    return compute_score(response, ground_truth)


def _quick_or_none(response: str, ground_truth: str) -> dict | None:
    """Quick companion of the pool test: decides everything but "SLEEP" and the sympy-only case."""
    return None if response == "SLEEP" else math_dapo.quick_score(response, ground_truth)


def test_pool_scores_quick_items_inline_and_the_rest_under_the_limit():
    responses = ["Answer: 1"] * 10 + ["SLEEP", SYMPY_ONLY[0]] + ["Answer: 3"] * 10
    truths = ["1"] * 10 + ["1", SYMPY_ONLY[1]] + ["2"] * 10
    with RewardPool(num_workers=1, timeout_s=TIMEOUT_S, score_fn=_hang_on_sleep,
                    quick_fns={None: _quick_or_none}) as pool:
        pool.wait_until_ready()
        start = time.monotonic()
        results = pool.score(responses, truths)
        # Not a timing bound: the hung item is abandoned rather than waited for (restarting the
        # worker may take seconds on a loaded 2-core box, never the hang's minute).
        assert time.monotonic() - start < HANG_S / 2
        assert pool.num_quick == 20 and pool.last_num_timeouts == 1
    assert results[10] == {"score": -1.0, "acc": False, "pred": "", "timed_out": True}
    assert results[11]["acc"] and not results[11]["timed_out"]  # decided by math-verify, in the worker
    expected = [compute_score(r, t) | {"timed_out": False} for r, t in zip(responses, truths)]
    assert results[:10] + results[12:] == expected[:10] + expected[12:]


def test_pool_refuses_a_quick_fn_without_a_scorer():
    with pytest.raises(ValueError, match=r"quick_fns \['nope'\] name no score fn"):
        RewardPool(num_workers=0, timeout_s=1.0, quick_fns={"nope": _quick_or_none})
