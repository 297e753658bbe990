"""The DAPO paper's scoring rule (verl <= 0.9.0's ``math_dapo``), written here from its description.

verl 0.9.1's ``math_dapo`` differs in one place: a tail with no "Answer:" line falls back to its last
``\\boxed{}`` (here: "[INVALID]", scored -1), as the paper's numbers were not. tests/unit/test_scorers.py
checks this rule against verl 0.9.1 as shipped: equal everywhere else.

This is the metric behind the paper's AIME avg@32 and verl's reproduction numbers (reference
docs/reference/dapo.md 2.4). Use it to compare with them; our own scorer (math_dapo.py, compares values) is
more lenient in some places and stricter in others (docs/reward.md lists the differences).

The rule, step by step:
1. Only the last PAPER_TAIL_CHARS = 300 characters of the response are read.
2. Minerva-style extraction: every match of ``Answer\\s*:\\s*([^\\n]+)`` (case-insensitive, no word
   boundary, the blank after the colon may span lines); the LAST match is the answer. No match
   gives the placeholder "[INVALID]".
3. ``normalize_final_answer`` on the answer and on the ground truth, in this order: keep the text
   after the last "="; apply SUBSTITUTIONS (in list order); delete REMOVED_EXPRESSIONS (in list
   order); take the part between the first pair of "$"; unwrap \\text{}, \\textbf{}, \\overline{}
   and \\boxed{} (the boxed unwrap is greedy, to the last "}"); rewrite "\\fracab" as
   "\\frac{a}{b}" and "\\sqrta" as "\\sqrt{a}"; drop "$"; drop commas if what remains is digits;
   strip blanks.
4. Correct iff the two normalised strings are EQUAL. Score +1 / -1.

Consequences, all intended (they are the original's behaviour): "**Answer:** 42" reads "**42",
"Answer: 42." keeps the period, "042" and "\\frac{84}{2}" are not "42", and an answer line that
ends more than 300 characters before the end of the response is not seen. Unit words are deleted
anywhere in the string, not only at its end.
"""

import re

PAPER_TAIL_CHARS = 300
INVALID = "[INVALID]"

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# (old, new) replacements, applied in this order. Spaces go after "an "/"a " are removed.
SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Deleted wherever they occur, in this order (units, filler, LaTeX spacing and degree marks). verl's
# copy of the Minerva list has no "ft" (checked against its source): "12 ft" stays "12ft" there.
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_REGEX_STEPS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep the first $...$
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize_final_answer(answer: str) -> str:
    """The paper rule's normalisation of an answer string (module docstring, step 3)."""
    if (digits := answer.strip()).isascii() and digits.isdigit():
        return digits  # "Answer: 42", the prompted form: no step of the rule changes an ASCII digit string
    return normalize_steps(answer)


def normalize_steps(answer: str) -> str:
    """normalize_final_answer's steps, every one of them (its fast path's reference)."""
    s = answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        s = s.replace(old, new)
    for expr in REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    for pattern, repl in _REGEX_STEPS:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer(response: str) -> str:
    """The last "Answer:" match in the last 300 characters, or "[INVALID]"."""
    matches = _ANSWER_RE.findall(response[-PAPER_TAIL_CHARS:])
    return matches[-1] if matches else INVALID


def compute_score(response: str, ground_truth: str) -> dict:
    """{"score": +1.0 / -1.0, "acc": bool, "pred": normalised answer} by the paper's rule.

    "pred" is "[INVALID]" when there is no Answer line (as in the original). Never raises.
    """
    try:
        pred = normalize_final_answer(extract_answer(response))
        correct = pred == normalize_final_answer(str(ground_truth))
    except Exception:  # noqa: BLE001 - a reward must never crash the trainer
        pred, correct = "", False
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
