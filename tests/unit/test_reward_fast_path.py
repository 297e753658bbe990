"""reward/exact_forms.py against sympy: where the exact evaluator decides, it gets sympy's value;
where it rejects, the answer scores incorrect; the scorer never accepts what sympy alone rejects."""

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import compute_score, math_dapo
from megatron_dapo.reward.exact_forms import Rejected, Undecided, _exact_root, _split_square, integer_value

# --------------------------------------------------------------- generated expressions

_BINARY_OPS = ["+", "-", "\\cdot ", "\\times ", "*", "/", "\\div "]
_EXPONENTS = ["2", "{3}", "{-2}", "{\\frac{1}{2}}", "{\\frac{3}{2}}"]
_SLOW = [HealthCheck.too_slow, HealthCheck.filter_too_much]
_leaves = st.one_of(
    st.integers(0, 40).map(str),
    st.integers(0, 30).map(lambda n: f"\\sqrt{{{n * n}}}"),  # perfect squares
    st.integers(0, 60).map(lambda n: f"\\sqrt{{{n}}}"),  # mostly not
    st.integers(0, 5).map(lambda n: f"\\sqrt[3]{{{n ** 3}}}"),
    st.integers(0, 6).map(lambda n: f"{n}!"),
    st.tuples(st.integers(0, 9), st.integers(0, 9)).map(lambda t: f"\\binom{{{t[0]}}}{{{t[1]}}}"),
)


def _extend(children):
    pair = st.tuples(children, children)
    return st.one_of(
        st.tuples(children, st.sampled_from(_BINARY_OPS), children).map("".join),
        children.map(lambda c: f"({c})"),
        children.map(lambda c: f"-{c}"),
        pair.map(lambda t: f"\\frac{{{t[0]}}}{{{t[1]}}}"),
        st.tuples(children, st.integers(-3, 4)).map(lambda t: f"({t[0]})^{{{t[1]}}}"),
        st.tuples(st.integers(0, 12), st.sampled_from(_EXPONENTS)).map(lambda t: f"{t[0]}^{t[1]}"),
        children.map(lambda c: f"\\sqrt{{{c}}}"),
        pair.map(lambda t: f"({t[0]})({t[1]})"),  # juxtaposition: a product, or a mixed number
        pair.map(lambda t: f"{t[0]}\\sqrt{{{t[1]}}}"),
    )


_expressions = st.recursive(_leaves, _extend, max_leaves=6).filter(math_dapo._expression_is_safe)


def _outcome(expr: str):
    try:
        return integer_value(expr)
    except (Rejected, Undecided) as e:
        return type(e)


@pytest.mark.slow
@settings(max_examples=250, deadline=None, suppress_health_check=_SLOW)
@given(expr=_expressions)
def test_exact_value_is_sympys_value(expr):
    """Decided: the value (or "not an integer") equals sympy's. Rejected or Undecided: nothing to compare."""
    fast = _outcome(expr)
    event(fast.__name__ if isinstance(fast, type) else "decided")
    if isinstance(fast, type):
        return
    assert fast == math_dapo._sympy_value(expr), expr


@settings(max_examples=150, deadline=None, suppress_health_check=_SLOW)
@given(expr=_expressions, offset=st.sampled_from([0, 0, 1, -1]))
def test_never_accepts_what_sympy_alone_rejects(expr, offset):
    """End to end: the scorer with exact_forms accepts an answer only if the sympy-only path does."""
    fast = _outcome(expr)
    target = (fast if isinstance(fast, int) else 42) + offset
    response = f"So the computation gives the result below.\n\nAnswer: ${expr}$"
    if compute_score(response, str(target))["acc"]:
        assert compute_score(response, str(target), sympy_only=True)["acc"], expr


# --------------------------------------------------------------- fixed forms


def _no_sympy(expr):
    raise AssertionError(f"sympy was called on {expr!r}")


# (answer, integer value): forms common in model answers and in benchmarks/reward_throughput.py.
COMMON_FORMS = [
    ("\\sqrt{1764}", 42), ("50 - 2^{3}", 42), ("\\frac{84}{2}", 42), ("\\dfrac{84}{2}", 42), ("2^{5}+10", 42),
    ("6 \\times 7", 42), ("6\\cdot 7", 42), ("84 \\div 2", 42), ("\\binom{7}{2}", 21), ("5!", 120),
    ("\\left(\\frac{84}{4}\\right) \\cdot 2", 42), ("-\\frac{6}{2}", -3), ("(\\sqrt{5}+1)(\\sqrt{5}-1)", 4),
    ("\\sqrt{2}\\cdot\\sqrt{8}", 4), ("\\sqrt[3]{27}", 3), ("8^{\\frac{2}{3}}", 4), ("2^{-1}\\cdot 84", 42),
    ("\\frac{2}{\\sqrt{3}-1}-\\sqrt{3}", 1), ("2^{10}", 1024), ("\\sqrt{\\frac{9}{4}}\\cdot 2", 3),
    ("\\sqrt{2^{101}}\\cdot\\sqrt{2}", 2**51), ("\\sqrt{2}", None), ("\\frac{3}{2}", None),
    ("2^{-2}", None), ("\\sqrt{999999999999}", None),
]


@pytest.mark.parametrize("expr, value", COMMON_FORMS, ids=[f[0] for f in COMMON_FORMS])
def test_common_forms_never_reach_sympy(monkeypatch, expr, value):
    monkeypatch.setattr(math_dapo, "_sympy_value", _no_sympy)
    math_dapo._expression_value.cache_clear()
    response = f"Answer: ${expr}$"
    if value is None:
        assert not compute_score(response, "1")["acc"] and not compute_score(response, "0")["acc"]
        return
    assert integer_value(math_dapo.normalize_answer(expr)) == value
    assert compute_score(response, str(value))["acc"]
    assert not compute_score(response, str(value + 1))["acc"]
    math_dapo._expression_value.cache_clear()


# (answer, what math-verify reads): each scored correct by sympy alone, none provably equal.
REJECTED = [
    ("2(3)", 5), ("(2)(3)", 5), ("-2(3)", -5), ("\\frac{6}{2}(4)", 7), ("2\\sqrt{2}\\sqrt{2}", 4),
    ("4/\\sqrt{2}\\sqrt{2}", 2), ("6/2\\sqrt{3}\\cdot\\sqrt{3}", 3), ("\\frac{1}{\\frac{1}{0}}", 0),
]


@pytest.mark.parametrize("expr, sympy_reading", REJECTED, ids=[r[0] for r in REJECTED])
def test_ambiguous_or_undefined_forms_are_rejected(expr, sympy_reading):
    response = f"Answer: ${expr}$"
    assert compute_score(response, str(sympy_reading), sympy_only=True)["acc"]  # the old false positive
    with pytest.raises(Rejected):
        integer_value(expr)
    assert not compute_score(response, str(sympy_reading))["acc"]


@pytest.mark.parametrize("expr", [
    "((10^{999})^{999})^{999}",  # passes the screen; sympy does not finish
    "{{10^{999}}^{999}}^{999}",
    "(10^{999})^{999}-(10^{999})^{999}+42",
    "2^5!",  # math-verify: (2^5)!
    "\\sqrt{-4}^{2}",
])
def test_large_or_unknown_powers_are_rejected_without_sympy(monkeypatch, expr):
    monkeypatch.setattr(math_dapo, "_sympy_value", _no_sympy)
    math_dapo._expression_value.cache_clear()
    assert not compute_score(f"Answer: ${expr}$", "42")["acc"]
    math_dapo._expression_value.cache_clear()


@pytest.mark.parametrize("expr, value", [("\\sqrt{-4}\\cdot\\sqrt{-4}", -4), ("007+1", 8), ("\\sqrt4", 2)])
def test_undecided_forms_go_to_sympy(monkeypatch, expr, value):
    """Outside the grammar, with no power, factorial or juxtaposition: sympy decides (the old path)."""
    calls = []
    sympy_value = math_dapo._sympy_value
    monkeypatch.setattr(math_dapo, "_sympy_value", lambda e: calls.append(e) or sympy_value(e))
    math_dapo._expression_value.cache_clear()
    with pytest.raises(Undecided):
        integer_value(expr)
    assert compute_score(f"Answer: ${expr}$", str(value))["acc"] and calls == [expr]
    math_dapo._expression_value.cache_clear()


# --------------------------------------------------------------- arithmetic helpers


@settings(max_examples=300, deadline=None)
@given(square=st.integers(1, 10**3), free=st.integers(1, 10**6), small=st.integers(0, 60))
def test_split_square(square, free, small):
    n = square * square * free * 2**small  # odd part <= 10^12: always split
    a, d = _split_square(n)
    assert a * a * d == n
    assert all(d % (p * p) for p in range(2, math.isqrt(d) + 1)), (n, d)


@given(root=st.integers(0, 10**30), k=st.integers(2, 12))
def test_exact_root(root, k):
    assert _exact_root(root**k, k) == root
    if root > 1:
        assert _exact_root(root**k + 1, k) is None
