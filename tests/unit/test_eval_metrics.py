"""avg@k, pass@k (unbiased, against brute force), cons@k (majority vote, ties, empty preds)."""

from itertools import combinations
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.eval_metrics import avg_at_k, cons_at_k, eval_metrics, pass_at_k, problem_metrics


def brute_force_pass_at_k(accs: list[bool], k: int) -> float:
    """Mean over all k-subsets of 'any correct'."""
    subsets = list(combinations(range(len(accs)), k))
    return sum(any(accs[i] for i in s) for s in subsets) / len(subsets)


@settings(max_examples=200, deadline=None)
@given(accs=st.lists(st.booleans(), min_size=1, max_size=10), data=st.data())
def test_pass_at_k_matches_brute_force(accs, data):
    k = data.draw(st.integers(1, len(accs)))
    assert pass_at_k(len(accs), sum(accs), k) == pytest.approx(brute_force_pass_at_k(accs, k), abs=1e-12)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))  # 0.7
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 1, 32) == 1.0  # k = n: any correct
    assert pass_at_k(32, 31, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert avg_at_k([True, False, True, True], k=2) == 0.5
    with pytest.raises(ValueError):
        avg_at_k([], 1)


def test_cons_at_k_majority_ties_and_empty_preds():
    # "42" wins 2-1 although the first sample says "7".
    assert cons_at_k([(False, "7"), (True, "42"), (True, "42")]) == 1.0
    assert cons_at_k([(True, "42"), (False, "7"), (False, "7")]) == 0.0
    # Tie 1-1: the pred seen first wins.
    assert cons_at_k([(True, "42"), (False, "7")]) == 1.0
    assert cons_at_k([(False, "7"), (True, "42")]) == 0.0
    # Empty preds vote, and an empty winner is wrong even if marked correct.
    assert cons_at_k([(False, ""), (False, ""), (True, "42")]) == 0.0
    assert cons_at_k([(True, ""), (True, "")]) == 0.0
    assert cons_at_k([(False, ""), (True, "42"), (True, "42")]) == 1.0
    # First k samples only.
    assert cons_at_k([(False, "7"), (True, "42"), (True, "42")], k=1) == 0.0


def test_eval_metrics_hand_computed_summary():
    problems = [
        [(True, "1"), (True, "1"), (False, "2"), (False, "")],   # c = 2
        [(False, "5"), (False, "5"), (False, "6"), (True, "9")],  # c = 1, majority wrong
        [(False, ""), (False, ""), (False, "3"), (False, "4")],   # c = 0
    ]
    summary, per_problem = eval_metrics(problems, ks=[1, 2, 4])
    assert [m.num_correct for m in per_problem] == [2, 1, 0]
    assert summary["avg@4"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert summary["avg@1"] == pytest.approx(1 / 3)  # first samples: T, F, F
    assert summary["pass@1"] == pytest.approx(summary["avg@4"])  # unbiased pass@1 = mean acc
    assert summary["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6) + 0.0) / 3)
    assert summary["pass@4"] == pytest.approx(2 / 3)
    assert summary["cons@4"] == pytest.approx(1 / 3)
    assert per_problem[0] == problem_metrics(problems[0], [1, 2, 4])


def test_eval_metrics_defaults_and_errors():
    """By default the paper's three, all over the n samples: avg@1 (the first sample alone) beside
    pass@1 (the same as avg@n, unbiased) read as two different accuracies; neither is logged."""
    summary, _ = eval_metrics([[(True, "1")] * 32, [(False, "2")] * 32])
    assert set(summary) == {"avg@32", "pass@32", "cons@32"}
    assert summary["avg@32"] == summary["pass@32"] == summary["cons@32"] == 0.5
    with pytest.raises(ValueError, match="same number"):
        eval_metrics([[(True, "1")], [(True, "1"), (True, "1")]])
    with pytest.raises(ValueError):
        eval_metrics([])
