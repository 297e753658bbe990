"""Rule-based reward for DAPO-Math-17k and AIME: integer ground truths, "Answer:" lines.

The DAPO prompt (docs/reference/dapo.md 1.7) asks the model to end with a line "Answer: $Answer".
`compute_score` reads the last such line in the tail of the response, normalises it and compares
its VALUE with the integer ground truth.

Deviations from verl's `math_dapo.compute_score` (docs/reference/dapo.md 2.4; ours again in
paper_rule.py, the evaluation default), which compares normalised STRINGS:
- Values, not strings: "42.0", "1,000", "042", "\\frac{84}{2}" and "2^{5}+10" all equal their
  integers. Plain numbers and integer fractions take a pure-Python fast path (Decimal or Fraction
  compare, microseconds). Other expressions are evaluated exactly by exact_forms.py (integers,
  fractions, powers, square and n-th roots, binomials, factorials; tens of microseconds) in
  math-verify's own reading, and only what that leaves goes to math-verify's `parse` (2-5 ms);
  we compare the exact value: no float tolerance, and we do not call `verify`.
- Tail of TAIL_CHARS=1000 characters instead of 300 (see TAIL_CHARS).
- Zero false positives come first. Anything ambiguous is scored incorrect: lists ("3, 42"),
  hedges ("42 or 43"), relations other than "=", words that are not known units, decimals
  inside expressions, several different boxed answers, unbalanced LaTeX, non-ASCII leftovers,
  juxtaposed rational factors ("2(3)": math-verify reads it as the mixed number 5), "a/b c"
  (math-verify: a/(b c)), division by zero, values over exact_forms.MAX_BITS bits.
- Words are judged by ALLOWLISTS, never lists of hedges: prose around \\boxed{} ("so the total is
  \\boxed{42}") and words before "=" ("the answer = 42") are dropped only if every word is known
  to be harmless. A blocklist fails open ("at least", "anything but", "is false": one more word to
  forget each); an allowlist fails closed: an unknown word stays, and the answer is rejected.
  A box that holds only a box (\\boxed{\\boxed{42}}, any depth) reads as its content.
- If the text after "Answer:" is empty, we read the next paragraph instead. The prompt's "on its
  own line after Answer:" is often read that way, and verl's regex also crosses the newline.
- Percent signs are dropped ("42\\%" equals 42). The ground truth is an integer, so a model that
  writes 42% is answering a "what percent" question whose ground truth is 42.
- The ground truth may be a str ("540", "-3", "1,000") or an int. A ground truth that is not an
  integer (outside DAPO-Math) is matched by exact equality of the normalised strings, as in verl.

math-verify is called with its signal-based timeouts disabled (parsing_timeout=None). Such
timeouts work only on the main thread. Time is bounded by RewardPool (pool.py). Expressions that
are known to be slow for sympy (nested powers, big factorials, long literals) are rejected
before parsing, and sympy sees no power or factorial at all (exact_forms.integer_value rejects
those it cannot evaluate), so inline scoring is fast as well: ((10^{999})^{999})^{999} passed the
screen and hung sympy.
"""

import functools
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from megatron_dapo.reward import exact_forms

# The Answer line ends the response, but models often add a closing sentence or a display-math
# block after it. 300 characters (verl) can cut the "Answer:" keyword off. 1000 characters
# (about 280 tokens) keep it, and scanning stays cheap on 20k-token responses.
TAIL_CHARS = 1000
# Answer text longer than this is not a single integer. The cap also bounds regex and sympy work.
MAX_ANSWER_CHARS = 300
# Only short, simple expressions go to sympy. See _expression_is_safe.
MAX_EXPR_CHARS = 150
MAX_LITERAL_DIGITS = 30
MAX_PRED_CHARS = 200

_ANSWER_RE = re.compile(r"(?i)\banswer[ \t]*(?:\*\*|__)?[ \t]*:")
_LEAD_JUNK = " \t*_:}"
_TRAIL_JUNK = " \t*_.,;:\\"

# Unicode minus signs, dashes and spaces that models emit in place of ASCII ones. "\u00b0" is the
# degree sign. We avoid NFKC on purpose: it would turn "42\u00b2" (42 squared) into "422".
_UNICODE_MAP = {
    **{ord(c): "-" for c in "\u2212\u2010\u2011\u2012\u2013\u2014\ufe63\uff0d"},
    **{ord(c): " " for c in "\u00a0\u2002\u2003\u2009\u200a\u202f\u3000"},
    **{ord(c): None for c in "\u200b\u200c\u200d\u2060\ufeff"},
    ord("\u00b0"): "^\\circ",
    ord("\u00d7"): "\\times ",
    ord("\u00f7"): "\\div ",
    ord("\u22c5"): "\\cdot ",
}
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^|<>]{0,40}\|>|</?s>")
_THOUSANDS_LATEX_RE = re.compile(r"(?<=\d)(?:\\,|\{,\}|\\ |\\;|\\:|\\!)(?=\d{3}(?!\d))")
# "~" is a LaTeX tie only after a word ("42~cm"). Leading "~42" means "about 42" and stays (rejected).
_LATEX_SPACE_RE = re.compile(r"\\[,;: ]|\\q?quad(?![a-zA-Z])|(?<=[A-Za-z0-9})$])~")
_DELIMITER_RE = re.compile(r"\$|\\[()\[\]]|\\(?:left|right|displaystyle)(?![a-zA-Z])|\\!")
_UNWRAP_CMDS = ("text", "textbf", "textrm", "textit", "mathrm", "mathbf", "mathit", "mbox", "emph")
_UNWRAP_RE = re.compile(r"\\(?:%s)\s*\{" % "|".join(_UNWRAP_CMDS))
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_ALIASES_RE = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_BINOM_ALIASES_RE = re.compile(r"\\[dt]binom(?![a-zA-Z])")
_LEAD_FILLER_RE = re.compile(r"(?i)^(?:the\s+)?(?:final\s+)?(?:answer\s+)?is\s*:?\s*")
_TRAIL_FILLER_RE = re.compile(r"(?i)[.\s]*i\s+hope\s+it\s+is\s+correct\W*$")
# Prose around \boxed{} and words before "=" are dropped only if all their words are in this list.
# Absent on purpose: bounds (least, most, more, less, than, under, over, between, bound; minimum,
# smallest, ...: "the maximum is 42" bounds a count), negations (not, no, but, except, false, wrong),
# conditions (if, unless, when, such, can, could, possible), estimates (about, approximately, around,
# roughly, nearly, almost, guess), operations (and, or, plus, minus, times, half, square), "a"/"one"
# ("one solution is") and single letters ("x \boxed{2}" is a product, "e.g. \boxed{2}" an example).
_HARMLESS_WORDS = frozenset({
    "the", "this", "that", "it", "it's", "that's", "there", "here", "which", "we", "our", "my", "is", "are",
    "be", "must", "so", "thus", "therefore", "hence", "then", "finally", "get", "gets", "obtain", "obtained",
    "have", "has", "find", "found", "give", "gives", "yields", "equals", "equal", "to", "final", "answer",
    "result", "solution", "value", "required", "desired", "correct", "exactly", "of", "sum", "total",
    "number", "count", "ways", "remainder", "product", "difference", "quotient", "area", "perimeter",
    "volume", "length"})
# Before "=", capitals name points only after a geometry command ("AT LEAST X = 4" is prose), and
# no other command may appear ("x \approx y = 4").
_POINTS_RE = re.compile(r"\\(?:angle|measuredangle|triangle|overline|widehat|overarc)\s*\{?\s*[A-Z]{1,4}\b")
_NAME_COMMANDS = frozenset({
    "alpha", "beta", "gamma", "delta", "theta", "lambda", "mu", "pi", "sigma", "phi", "omega", "angle",
    "measuredangle", "triangle", "overline", "widehat", "overarc", "hat", "bar", "vec", "sin", "cos", "tan",
    "log", "ln", "max", "min", "gcd", "operatorname", "lfloor", "rfloor", "lceil", "rceil", "prime"})
# Punctuation that may surround a box. Not "!" (5! is 120), "?" (a question), "-" or "~".
_PROSE_RE = re.compile(r"[A-Za-z\s.,:;'\"]*")
# Units that never change the value of the number before them (no "thousand", "squared", ...).
_UNITS = (
    "degrees?|deg|cm|mm|km|m|meters?|metres?|inch(?:es)?|in|ft|feet|foot|yards?|miles?|units?"
    "|dollars?|cents?|seconds?|sec|s|minutes?|min|hours?|hrs?|days?|weeks?|months?|years?"
    "|ways|points?|people|students|integers?|numbers?|values?|solutions?|pairs?|triples?|"
    "outcomes|sequences|subsets|steps|moves|times|digits|terms|squares|triangles|rectangles"
    # the rest of the paper rule's unit list (paper_rule.REMOVED_EXPRESSIONS)
    "|mph|pounds?|lbs?|gm|grams?|edges?|meals?|multiples?|tickets?|children"
)
_UNIT_SUFFIX_RE = re.compile(
    r"(?<=[0-9})])\s*(?:(?:(?:square|sq\.?|cubic)\s+)?(?:%s)\b(?:\^\{?[23]\}?)?|\^\s*\{?\s*\\circ\s*\}?"
    r"|\\circ|\\degree|%%|\\%%|percent)\s*$" % _UNITS
)
_RELATION_BEFORE_EQ_RE = re.compile(r"[<>,;~]|!\s*$|\b(?:and|or)\b")
# "2x = 42", "-x = 42", "x^2 = 42" or "\\frac{x}{2} = 42" do not say that x is 42.
_NOT_A_NAME_RE = re.compile(r"^\s*[-+\d.]|[\^/]|\\(?:frac|sqrt|cdot|times)|\d\s*[a-zA-Z(\\]")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
_NUMBER_RE = re.compile(r"[+-]?\d+(?:\.\d+)?", re.ASCII)
_FRACTION_RE = re.compile(
    r"([+-]?)\\frac\{\s*([+-]?\d+)\s*\}\{\s*([+-]?\d+)\s*\}|([+-]?\d+)\s*/\s*([+-]?\d+)", re.ASCII
)
_EXPR_CHARS_RE = re.compile(r"[0-9a-z+\-*/^(){}\[\]!\s\\]*", re.ASCII)
_EXPR_COMMANDS = {"frac", "sqrt", "cdot", "times", "div", "binom"}
_COMMAND_RE = re.compile(r"\\([a-zA-Z]+)")
# Mixed numbers ("3\\frac{1}{3}" is 10/3, sympy reads 3*(1/3)) and digits juxtaposed across a
# space or bracket ("4 2", "\\frac{8}{4}2"): no single reading is safe.
_AMBIGUOUS_RE = re.compile(r"\d\s*\\frac|[)}\]]\s*\d|\d\s+\d")
_POWER_CHAIN_RE = re.compile(r"\^\s*-?(?:\{[^{}]*\}|\(?[^(){}]*\)|\d+|\w)\s*\^")
_MV_CONFIG = None  # math-verify extraction config; built on first use (import is ~0.3 s)


def compute_score(response: str, ground_truth: str, *, sympy_only: bool = False) -> dict:
    """Scores one response against an integer ground truth.

    Returns {"score": 1.0 or -1.0, "acc": bool, "pred": str}. "pred" is the normalised answer text
    ("" when there is no Answer line). Never raises: any error scores incorrect. `sympy_only` sends
    every expression to sympy, uncached, as before exact_forms.py (benchmarks and tests compare).
    """
    try:
        return _score(response, ground_truth, sympy_only=sympy_only)
    except Exception:  # noqa: BLE001 - a reward must never crash the trainer
        return _result(False, "")


class NeedsSympy(Exception):
    """Only math-verify's parser can decide this answer (quick_score's signal to the pool)."""


def quick_score(response: str, ground_truth: str) -> dict | None:
    """compute_score's result wherever it is reached without math-verify, else None.

    Everything before sympy is pure Python bounded by the tail and the answer caps (extraction,
    normalisation, the number and fraction fast paths, the screen, exact_forms' evaluator), so
    RewardPool runs this in the trainer's own process and sends only the None items to its
    time-bounded workers. Raises only what compute_score would turn into an incorrect score.
    """
    try:
        return _score(response, ground_truth, sympy=False)
    except NeedsSympy:
        return None


def _score(response: str, ground_truth: str, *, sympy_only: bool = False, sympy: bool = True) -> dict:
    answer = extract_answer(response)
    if answer is None:
        return _result(False, "")
    pred = normalize_answer(answer)
    return _result(answer_matches(pred, ground_truth, sympy_only=sympy_only, sympy=sympy), pred[:MAX_PRED_CHARS])


def _result(correct: bool, pred: str) -> dict:
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}


def extract_answer(response: str) -> str | None:
    """Text after the last "Answer:" in the tail, up to the end of the line. None if absent."""
    tail = response[-TAIL_CHARS:]
    last = _last_answer_label(tail)
    if last is None:
        return None
    line, _, rest = tail[last.end():].partition("\n")
    if not line.strip(_LEAD_JUNK):
        # "Answer:" alone on its line: the answer is the next paragraph (e.g. a \[ ... \] block).
        line = rest.lstrip().split("\n\n", 1)[0].replace("\n", " ")
    return line[: MAX_ANSWER_CHARS + 1]


def _last_answer_label(tail: str) -> re.Match | None:
    """Last "Answer:" label in `tail`: rfind from the end, since a long response's label is near it."""
    lowered = tail.lower()
    if len(lowered) != len(tail):  # rare characters whose lower case is longer: scan slowly
        matches = list(_ANSWER_RE.finditer(tail))
        return matches[-1] if matches else None
    end = len(lowered)
    while (start := lowered.rfind("answer", 0, end)) >= 0:
        match = _ANSWER_RE.match(tail, start)  # \b still sees the character before `start`
        if match:
            return match
        end = start
    return None


def normalize_answer(text: str) -> str:
    """Removes markup, units and "x =" from an answer; the result is compared by value."""
    if _NUMBER_RE.fullmatch(stripped := text.strip()):
        return stripped  # the prompted "Answer: 42" form needs no other work
    s = text.translate(_UNICODE_MAP)
    s = _SPECIAL_TOKEN_RE.sub("", s)
    s = _THOUSANDS_LATEX_RE.sub(",", s)
    s = s.replace("\\$", " ").replace("\\%", "%")
    s = _LATEX_SPACE_RE.sub(" ", s)
    s = _DELIMITER_RE.sub("", s)
    s = _FRAC_ALIASES_RE.sub(r"\\frac", s)
    s = _BINOM_ALIASES_RE.sub(r"\\binom", s)
    s = _unwrap_all(s, _UNWRAP_RE)
    s = _unwrap_boxed(s)
    s = _TRAIL_FILLER_RE.sub("", s)
    s = _LEAD_FILLER_RE.sub("", s.lstrip(_LEAD_JUNK))
    s = _strip_edges(s)
    if "=" in s:
        lhs, _, rhs = s.rpartition("=")
        # "x = 42" -> "42", "m+n = 42" -> "42", "x = 40 + 2 = 42" -> "42". "x = 3, y = 42", "x >= 42",
        # "a = 1 or b = 42", "2x = 42" and "at least x = 42" keep their "=" and are rejected later.
        if (not _RELATION_BEFORE_EQ_RE.search(lhs) and not _NOT_A_NAME_RE.search(s.split("=", 1)[0])
                and _name_is_harmless(lhs)):
            s = _strip_edges(rhs)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return re.sub(r"^([+-])\s+(?=\d)", r"\1", s)


def _strip_edges(s: str) -> str:
    """Strips markdown, trailing punctuation, unit words and braces around the whole answer."""
    while True:
        before = s
        s = s.lstrip(_LEAD_JUNK).rstrip(_TRAIL_JUNK)
        s = _UNIT_SUFFIX_RE.sub("", s).rstrip(_TRAIL_JUNK)
        if len(s) >= 2 and s[0] + s[-1] in ("{}", "()") and _closing_brace(s, 0) == len(s) - 1:
            s = s[1:-1]
        if s == before:
            return s


def _closing_brace(s: str, open_idx: int) -> int:
    """Index of the bracket closing s[open_idx], or -1 if it is unbalanced."""
    opener = s[open_idx]
    closer = {"{": "}", "(": ")"}[opener]
    depth = 0
    for i in range(open_idx, len(s)):
        if s[i] == opener:
            depth += 1
        elif s[i] == closer:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _unwrap_all(s: str, command_re: re.Pattern) -> str:
    """Replaces every `\\cmd{X}` by `X` (innermost last). Unbalanced braces are left untouched."""
    for _ in range(20):  # bounded: nesting deeper than this is garbage anyway
        m = command_re.search(s)
        if m is None:
            return s
        close = _closing_brace(s, m.end() - 1)
        if close < 0:
            return s
        s = s[: m.start()] + s[m.end(): close] + s[close + 1:]
    return s


def _unwrap_boxed(s: str) -> str:
    """Unwraps \\boxed{X}. Prose around the box(es) is dropped only if _prose_is_harmless."""
    spans = _outer_boxes(s)
    if not spans:
        return s  # no box, or an unbalanced one: "\boxed" stays, so the answer is rejected
    contents = {_box_content(s[end:close]) for _, end, close in spans}
    if len(contents) > 1:
        return s  # two different boxed answers: rejected
    bounds = [0] + [i for start, _, close in spans for i in (start, close + 1)] + [len(s)]
    pieces = [s[bounds[i]: bounds[i + 1]] for i in range(0, len(bounds), 2)]
    if _prose_is_harmless(pieces):
        return contents.pop()
    # Other text stays ("at least 42", "42 degrees"); later steps accept only known forms (units, "x =").
    return _unwrap_all(s, _BOXED_RE) if len(spans) == 1 else s


def _outer_boxes(s: str) -> list[tuple[int, int, int]] | None:
    """(start, content start, closing brace) of each outermost box; None if one is unbalanced."""
    spans, pos = [], 0
    while m := _BOXED_RE.search(s, pos):
        close = _closing_brace(s, m.end() - 1)
        if close < 0:
            return None
        spans.append((m.start(), m.end(), close))
        pos = close + 1
    return spans


def _box_content(content: str) -> str:
    """Content of a box; a box that holds only a box reads as its content (\\boxed{\\boxed{4}})."""
    content = content.strip()
    while (m := _BOXED_RE.match(content)) and _closing_brace(content, m.end() - 1) == len(content) - 1:
        content = content[m.end(): -1].strip()
    return content


def _prose_is_harmless(pieces: list[str]) -> bool:
    """True iff the text around the boxes (pieces[i] lies before box i) may be dropped."""
    if not all(_PROSE_RE.fullmatch(p) for p in pieces):
        return False
    words = [re.findall(r"[a-z]+(?:'[a-z]+)?", p.lower()) for p in pieces]
    if not all(set(w) <= _HARMLESS_WORDS for w in words):
        return False
    # "of" next to a box makes its number an argument: "the sum of \\boxed{9}", "\\boxed{9} of them".
    beside = [w[-1] for w in words[:-1] if w] + [w[0] for w in words[1:] if w]
    return "of" not in beside


def _name_is_harmless(lhs: str) -> bool:
    """Words before "=" name the value ("the answer", "m + n", "\\angle ABC"), not hedge it ("at least x")."""
    if re.fullmatch(r"\s*[A-Z]{2,3}\s*", lhs):  # a segment or a point triple on its own: "AB = 42"
        return True
    if not set(_COMMAND_RE.findall(lhs)) <= _NAME_COMMANDS:
        return False
    words = re.findall(r"[A-Za-z]{2,}", _COMMAND_RE.sub(" ", _POINTS_RE.sub(" ", lhs)))
    return all(w.lower() in _HARMLESS_WORDS for w in words)


def answer_matches(pred: str, ground_truth: str, *, sympy_only: bool = False, sympy: bool = True) -> bool:
    """True iff the normalised answer `pred` has the value of `ground_truth` (see compute_score).
    ``sympy=False``: raises NeedsSympy where only math-verify could decide."""
    target = _parse_integer(ground_truth)
    if target is None:
        return _matches_non_integer(pred, ground_truth)
    if len(pred) > MAX_ANSWER_CHARS or not pred:
        return False
    if _NUMBER_RE.fullmatch(pred):  # fast path: plain integer or decimal, no sympy
        return Decimal(pred) == target
    if fraction := _FRACTION_RE.fullmatch(pred):  # second fast path: "\frac{84}{2}", "84/2"
        sign, num, den, num2, den2 = fraction.groups()
        if num is None:
            sign, num, den = "", num2, den2
        num, den = int(num) * (-1 if sign == "-" else 1), int(den)
        return den != 0 and Fraction(num, den) == target
    if not _expression_is_safe(pred):
        return False
    if sympy_only:
        value = _sympy_value(pred)
    elif sympy:
        value = _expression_value(pred)
    else:
        value = _exact_value(pred)
    return value is not None and value == target


@functools.lru_cache(maxsize=4096)  # answers repeat within the responses to one prompt
def _expression_value(expr: str) -> int | None:
    """Integer value of a screened expression (None: not an integer, or rejected)."""
    try:
        return _exact_value(expr)
    except NeedsSympy:  # no power, factorial or juxtaposition: sympy's work is small
        return _sympy_value(expr)


def _exact_value(expr: str) -> int | None:
    """exact_forms' value of a screened expression (None: not an integer, or rejected); NeedsSympy
    where it cannot decide."""
    try:
        return exact_forms.integer_value(expr)
    except exact_forms.Rejected:
        return None
    except exact_forms.Undecided:
        raise NeedsSympy(expr) from None


def integer_ground_truth(ground_truth: str | int) -> int | None:
    """The integer a ground truth stands for ("540", "-3", "1,000", "42.0"), as compute_score reads
    it; None for any other (compute_score then matches the normalised strings, not values)."""
    return _parse_integer(ground_truth)


@functools.lru_cache(maxsize=4096)  # ground truths repeat: 16 responses per prompt
def _parse_integer(ground_truth: str | int) -> int | None:
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        return ground_truth
    if not isinstance(ground_truth, str):
        return None
    s = normalize_answer(ground_truth)
    if not _NUMBER_RE.fullmatch(s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    return int(value) if value == value.to_integral_value() else None


def _expression_is_safe(expr: str) -> bool:
    """Cheap screen: only arithmetic LaTeX that sympy evaluates quickly may be parsed.

    Rejects (as incorrect) letters other than a few commands, decimals, commas, mixed numbers,
    juxtaposed digits (_AMBIGUOUS_RE), nested or chained powers (9^{9^{9}}), exponents over 3
    digits, factorials of more than 2 digits and long literals.
    """
    if len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS_RE.fullmatch(expr):
        return False
    commands = _COMMAND_RE.findall(expr)
    if not set(commands) <= _EXPR_COMMANDS:
        return False
    if re.search(r"[a-z]", _COMMAND_RE.sub("", expr)) or _AMBIGUOUS_RE.search(expr):
        return False
    if any(len(run) > MAX_LITERAL_DIGITS for run in re.findall(r"\d+", expr)):
        return False
    if _POWER_CHAIN_RE.search(expr) or re.search(r"\^\s*\d{4}", expr):
        return False
    for m in re.finditer(r"\^\s*[{(]", expr):
        exponent = expr[m.end(): _closing_brace(expr, m.end() - 1)]
        if "^" in exponent or "!" in exponent or re.search(r"\d{4}", exponent):
            return False
    if expr.count("!") != len(re.findall(r"(?<![\d)}!])\d{1,2}!(?!!)", expr)):
        return False
    return "binom" not in commands or not re.search(r"\d{4}", expr)


def warm_up() -> None:
    """Imports math-verify and runs its LaTeX parser once: its first use is slow, so a worker pays
    it before the first batch arrives."""
    if _sympy_value("2^{3}") != 8:
        raise RuntimeError("math-verify could not evaluate 2^{3}")


def _sympy_value(expr: str) -> int | None:
    """Exact integer value of a LaTeX expression via math-verify, or None if not an integer."""
    global _MV_CONFIG
    import sympy
    from math_verify import LatexExtractionConfig, parse

    if _MV_CONFIG is None:
        _MV_CONFIG = (LatexExtractionConfig(),)
    parsed = parse(
        f"${expr}$",
        extraction_config=_MV_CONFIG,
        fallback_mode="no_fallback",
        extraction_mode="first_match",
        parsing_timeout=None,  # signal.alarm: main thread only; RewardPool bounds time instead
    )
    value = next((p for p in parsed if isinstance(p, sympy.Basic)), None)
    if value is None or not value.is_number:
        return None
    value = value.doit()
    if not value.is_Integer and not value.is_Rational and not value.is_Float:
        value = sympy.simplify(value)  # e.g. (\sqrt{5}+1)(\sqrt{5}-1)
    return int(value) if value.is_Integer else None


def _matches_non_integer(pred: str, ground_truth) -> bool:
    """Non-integer ground truth (not in DAPO-Math): exact match of the normalised strings, as verl."""
    if not isinstance(ground_truth, str):
        return False
    gold = normalize_answer(ground_truth)
    return bool(gold) and len(pred) <= MAX_ANSWER_CHARS and pred == gold
