"""Exact values of short LaTeX arithmetic without sympy: integers, +, -, *, /, \\frac, ^, \\sqrt, \\binom, n!.

math_dapo.answer_matches calls `integer_value` on answers that passed its screen
(math_dapo._expression_is_safe) before it asks sympy: math-verify's parse costs milliseconds per
answer, this microseconds (docs/performance.md). Values are exact: Fractions, and sums of rational multiples of
square roots of distinct squarefree integers (`Surd`). Such roots are linearly independent over
the rationals, so a value with a nonzero root term is irrational and never equals an integer.

The grammar and its precedence are those of math-verify's LaTeX parser (latex2sympy2_extended,
PS.g4: additive > mp > unary > postfix > exp > comp), so a value decided here is the one sympy gets:
- `a/b c` is a/(b c): juxtaposition (implicit product) binds tighter than / and \\div.
- `-2^{2}` is -4, and `2^10` is 2^{10} (LaTeX would typeset 2^{1}0; math-verify reads 1024).
- `n!` only on a bare integer literal, as the screen allows.
Two outcomes other than a value:
- `Rejected`: no single reading is safe, the value is undefined, or it is too large. The answer
  scores incorrect: juxtaposed factors that are both rational, since math-verify reads some as
  mixed numbers ("2(3)" as 5, "\\frac{6}{2}(4)" as 7, "2\\sqrt{2}\\sqrt{2}" as 4); `a/b c`, which
  math-verify reads as a/(b c) where most readers see (a/b) c; division by zero
  ("\\frac{1}{\\frac{1}{0}}" is 0 in sympy); numbers over MAX_BITS bits. Also any text we cannot
  evaluate that holds a power, a factorial or possibly juxtaposed factors (_MAY_JUXTAPOSE_RE):
  sympy might not finish (((10^{999})^{999})^{999} passes math_dapo's screen) or might read a
  mixed number.
- `Undecided`: the rest of what we cannot evaluate: unbraced arguments ("\\sqrt4"), brace and
  bracket groups, leading zeros, sums of three or more roots under a division, square roots of
  negative or irrational values, other roots of non-powers. The caller asks sympy; without powers,
  factorials or juxtapositions its work is small.
"""

import math
import re
from fractions import Fraction

# Numerators and denominators above this many bits are rejected (10^999 has 3319 bits).
MAX_BITS = 10_000
# Distinct square roots in one value, and the trial divisors used to split a radicand into
# square * squarefree (enough for any radicand up to 10^12, and for any that is a square times a
# number with small prime factors, such as 2^{101}).
MAX_TERMS = 8
MAX_TRIAL_DIVISOR = 10_000
MAX_ROOT_INDEX = 64
MAX_SURD_POWER = 16
MAX_BINOM_N = 10_000

_TOKEN_RE = re.compile(r"\s*(?:(\d+)|\\(frac|sqrt|binom|cdot|times|div)(?![a-zA-Z])|([-+*/^()!{}\[\]]))")
_OPERATOR_ALIASES = {"cdot": "*", "times": "*", "div": "/"}
_FACTOR_STARTS = frozenset({"(", "{", "[", "frac", "sqrt", "binom"})
# The end of one operand followed by the start of another: "2(3)", ")(", "2\\sqrt", "}{" (also between
# \\frac's arguments: a superset, so it may reject more than it must, never less).
_MAY_JUXTAPOSE_RE = re.compile(r"[\d)\]}!]\s*(?:[(\[{]|\\(?:frac|sqrt|binom)(?![a-zA-Z]))")


class Undecided(Exception):
    """Outside the exact grammar or its bounds: the caller may ask sympy."""


class Rejected(Exception):
    """Ambiguous, undefined or too large: the answer must score incorrect."""


def integer_value(expr: str) -> int | None:
    """The integer value of `expr`, or None if its exact value is not an integer.

    Raises Rejected (score incorrect) or Undecided (ask sympy); see the module docstring.
    """
    try:
        value = _Parser(expr).parse()
    except (Undecided, RecursionError):
        if _MAY_JUXTAPOSE_RE.search(expr):
            raise Rejected(f"juxtaposed factors outside the exact grammar: {expr!r}") from None
        if "^" in expr or "!" in expr:
            raise Rejected(f"power or factorial outside the exact grammar: {expr!r}") from None
        raise Undecided(expr) from None
    q = value.rational()
    return q.numerator if q is not None and q.denominator == 1 else None


class Surd:
    """Exact value sum(q * sqrt(d)) over distinct squarefree d >= 1 (d = 1 is the rational part)."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict[int, Fraction]):
        if len(terms) > MAX_TERMS:
            raise Undecided("too many square roots")
        for q in terms.values():
            if max(q.numerator.bit_length(), q.denominator.bit_length()) > MAX_BITS:
                raise Rejected("number too large")
        self.terms = {d: q for d, q in terms.items() if q}

    @classmethod
    def of(cls, q: int | Fraction) -> "Surd":
        return cls({1: Fraction(q)})

    def rational(self) -> Fraction | None:
        """The value if it is rational (no root term), else None."""
        if set(self.terms) - {1}:
            return None
        return self.terms.get(1, Fraction(0))

    def __neg__(self) -> "Surd":
        return Surd({d: -q for d, q in self.terms.items()})

    def __add__(self, other: "Surd") -> "Surd":
        terms = dict(self.terms)
        for d, q in other.terms.items():
            terms[d] = terms.get(d, 0) + q
        return Surd(terms)

    def __sub__(self, other: "Surd") -> "Surd":
        return self + -other

    def __mul__(self, other: "Surd") -> "Surd":
        terms: dict[int, Fraction] = {}
        for d1, q1 in self.terms.items():
            for d2, q2 in other.terms.items():
                g = math.gcd(d1, d2)  # sqrt(d1 d2) = g sqrt(d1/g * d2/g), and that radicand is squarefree
                d = (d1 // g) * (d2 // g)
                terms[d] = terms.get(d, 0) + q1 * q2 * g
        return Surd(terms)

    def inverse(self) -> "Surd":
        if not self.terms:
            raise Rejected("division by zero")
        if len(self.terms) == 1:
            ((d, q),) = self.terms.items()
            return Surd({d: 1 / (q * d)})  # 1 / (q sqrt d) = sqrt(d) / (q d)
        if len(self.terms) == 2:
            # 1 / (x + y) = (x - y) / (x^2 - y^2); x^2 - y^2 = q1^2 d1 - q2^2 d2 is rational, and not
            # zero, since d1 != d2 are squarefree.
            (d1, q1), (d2, q2) = self.terms.items()
            return Surd({d1: q1, d2: -q2}) * Surd.of(1 / (q1 * q1 * d1 - q2 * q2 * d2))
        raise Undecided("division by a sum of three or more roots")

    def power(self, exponent: "Surd") -> "Surd":
        e = exponent.rational()
        if e is None:
            raise Undecided("irrational exponent")
        base = self.rational()
        if e.denominator != 1:
            return _root(self, e.denominator).power(Surd.of(e.numerator))
        n = e.numerator
        if base is not None:
            if base == 0 and n < 0:
                raise Rejected("division by zero")
            bits = max(base.numerator.bit_length(), base.denominator.bit_length())
            if abs(n) * bits > MAX_BITS:
                raise Rejected("power too large")
            return Surd.of(base**n)
        if abs(n) > MAX_SURD_POWER:
            raise Undecided("power of a root too large")
        factor, result = (self.inverse() if n < 0 else self), Surd.of(1)
        for _ in range(abs(n)):
            result = result * factor
        return result


def _root(value: Surd, index: int) -> Surd:
    """The principal `index`-th root of a rational value >= 0, when it is rational or a square root."""
    q = value.rational()
    if q is None or q < 0 or not 1 <= index <= MAX_ROOT_INDEX:
        raise Undecided("root of an irrational or negative value")
    num, den = _exact_root(q.numerator, index), _exact_root(q.denominator, index)
    if num is not None and den is not None:
        return Surd.of(Fraction(num, den))
    if index != 2:
        raise Undecided("irrational root other than a square root")
    square, free = _split_square(q.numerator * q.denominator)  # sqrt(p/q) = sqrt(p q) / q
    return Surd({free: Fraction(square, q.denominator)})


def _exact_root(n: int, k: int) -> int | None:
    """r with r**k == n for n >= 0, or None."""
    if n < 2:
        return n
    x = 1 << -(-n.bit_length() // k)  # 2^ceil(bits/k) >= the root; Newton's steps then decrease
    while (y := ((k - 1) * x + n // x ** (k - 1)) // k) < x:
        x = y
    return x if x**k == n else None


def _split_square(n: int) -> tuple[int, int]:
    """(a, d) with n = a*a*d and d squarefree, for n > 0, by trial division up to MAX_TRIAL_DIVISOR."""
    square, free, p = 1, 1, 2
    while p * p * p <= n and p <= MAX_TRIAL_DIVISOR:
        exponent = 0
        while n % p == 0:
            n //= p
            exponent += 1
        square *= p ** (exponent // 2)
        free *= p ** (exponent % 2)
        p += 1 if p == 2 else 2
    # n has no prime factor below p. If p^3 > n, n is 1, a prime, a product of two primes or a
    # prime squared: squarefree unless it is a square.
    r = math.isqrt(n)
    if r * r == n:
        return square * r, free
    if p * p * p <= n:
        raise Undecided("radicand with large prime factors")
    return square, free * n


class _Parser:
    """Recursive descent over math-verify's precedence; evaluates as it parses."""

    def __init__(self, expr: str):
        self.tokens, pos = [], 0
        while pos < len(expr):
            m = _TOKEN_RE.match(expr, pos)
            if m is None:
                if expr[pos:].isspace():
                    break
                raise Undecided("unknown token")
            number, command, symbol = m.groups()
            self.tokens.append(number or _OPERATOR_ALIASES.get(command, command) or symbol)
            pos = m.end()
        self.pos = 0

    def parse(self) -> Surd:
        value = self.expression()
        if self.pos != len(self.tokens):
            raise Undecided("trailing tokens")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Undecided("unexpected token")
        self.pos += 1
        return token

    def expression(self) -> Surd:
        value = self.product()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self) -> Surd:
        value, _ = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs, juxtaposed = self.unary()
            if op == "*":
                value = value * rhs
            elif juxtaposed:
                raise Rejected("a/b c: math-verify divides by the product b c")
            else:
                value = value * rhs.inverse()
        return value

    def unary(self) -> tuple[Surd, bool]:
        """(value, whether it is a juxtaposition of factors)."""
        if self.peek() in ("+", "-"):
            sign = self.take()
            value, juxtaposed = self.unary()
            return (-value if sign == "-" else value), juxtaposed
        factors = [self.postfix()]
        while (token := self.peek()) is not None and (token.isdigit() or token in _FACTOR_STARTS):
            factors.append(self.postfix())
        # math-verify multiplies from the right, reading "integer, positive rational" as a mixed number.
        value = factors[-1]
        for factor in reversed(factors[:-1]):
            if factor.rational() is not None and value.rational() is not None:
                raise Rejected("juxtaposed rational factors: a product or a mixed number")
            value = factor * value
        return value, len(factors) > 1

    def postfix(self) -> Surd:
        start = self.pos
        value = self.power()
        if self.peek() == "!":
            literal = self.tokens[start]
            if self.pos != start + 1 or not literal.isdigit() or int(literal) > 999:
                raise Undecided("factorial of anything but an integer literal")
            self.take()
            value = Surd.of(math.factorial(int(literal)))
        return value

    def power(self) -> Surd:
        base = self.primary()
        if self.peek() != "^":
            return base
        self.take()
        token = self.peek()
        if token == "{":
            exponent = self.braced()
        elif token is not None and token.isdigit():  # math-verify reads "2^10" as 2^{10} (LaTeX: 2^{1}0)
            exponent = self.primary()
        else:
            raise Undecided("unbraced exponent")
        if self.peek() == "^":
            raise Undecided("chained powers")
        return base.power(exponent)

    def primary(self) -> Surd:
        token = self.take()
        if token.isdigit():
            if len(token) > 1 and token[0] == "0":
                raise Undecided("leading zero")
            return Surd.of(int(token))
        if token == "(":
            value = self.expression()
            self.take(")")
            return value
        if token == "frac":
            numerator = self.braced()
            return numerator * self.braced().inverse()
        if token == "sqrt":
            index = 2
            if self.peek() == "[":
                self.take()
                n = self.expression().rational()
                self.take("]")
                if n is None or n.denominator != 1:
                    raise Undecided("root index")
                index = n.numerator
            return _root(self.braced(), index)
        if token == "binom":
            n, k = self.braced().rational(), self.braced().rational()
            if n is None or k is None or n.denominator != 1 or k.denominator != 1 or not (
                    0 <= k and 0 <= n <= MAX_BINOM_N):
                raise Undecided("binomial outside 0 <= k, 0 <= n <= MAX_BINOM_N")
            return Surd.of(math.comb(n.numerator, k.numerator))
        raise Undecided("brace or bracket group, or an operator where a value belongs")

    def braced(self) -> Surd:
        self.take("{")
        value = self.expression()
        self.take("}")
        return value
