"""The bad-input campaign (benchmarks/bad_input_campaign.py): its verdict rules catch
what they must (a traceback, a wrong exit code, an error line that names nothing, a changed run
dir, a process left behind, a refusal after the model was built), and a slice of every class runs
clear in CI: each input a fresh `megatron-dapo` process answered in one line with nothing changed."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bad_input_campaign as bic  # noqa: E402
from _bad_input_cases import CLASSES, Case  # noqa: E402

CASE = Case("config", "x: wrong type", ("train", "x=abc"), "x")
GOOD = "some warning\nmegatron-dapo: config error: x must be an integer, got 'abc'\n"


def test_a_clear_answer_is_clear():
    assert bic.judge(CASE, 2, GOOD, 5.0, [], 0).clear


@pytest.mark.parametrize("rc, err, seconds, changed, left, problem", [
    (1, GOOD, 5.0, [], 0, "exit code 1, not 2"),
    (2, "Traceback (most recent call last):\n" + GOOD, 5.0, [], 0, "a traceback"),
    (2, "megatron-dapo: error: something is wrong\n", 5.0, [], 0, "does not name 'x'"),
    (2, GOOD + "a last line of noise\n", 5.0, [], 0, "not a megatron-dapo error line"),
    (2, "starting weights from /m\n" + GOOD, 5.0, [], 0, "after the model was built"),
    (2, GOOD, 5.0, ["/run/lock added"], 0, "changed: /run/lock added"),
    (2, GOOD, 5.0, [], 1, "1 process(es) left behind"),
    (2, GOOD, 99.0, [], 0, "took 99 s"),
])
def test_each_rule_catches_its_failure(rc, err, seconds, changed, left, problem):
    v = bic.judge(CASE, rc, err, seconds, changed, left)
    assert not v.clear and any(problem in p for p in v.problems), v.problems


def test_an_input_accepted_by_design_must_run():
    valid = Case("data", "dups", ("train",), "", valid="a small data set")
    assert bic.judge(valid, 0, "", 30.0, [], 0).clear
    assert not bic.judge(valid, 2, GOOD, 5.0, [], 0).clear


def test_the_changes_rule():
    before = {"a": "1", "b": "2"}
    assert bic.changes(before, {"a": "1", "b": "2", "c": "3"}, strict=False) == []
    assert bic.changes(before, {"a": "1", "b": "2", "c": "3"}, strict=True) == ["c added"]
    assert bic.changes(before, {"a": "9"}, strict=False) == ["a changed", "b gone"]


def test_spread_touches_the_whole_class():
    assert bic.spread(list(range(10)), 3) == [0, 4, 9]
    assert bic.spread([1, 2], 5) == [1, 2]


@pytest.mark.slow
@pytest.mark.extended
def test_a_slice_of_every_class_is_clear(tmp_path):
    verdicts = bic.campaign(list(CLASSES), workers=2, per_class=4, root=tmp_path, progress=False)
    assert {v.cls for v in verdicts} == set(CLASSES)
    bad = [f"{v.cls}: {v.name}: {v.problems} | {v.line}" for v in verdicts if not v.clear]
    assert not bad, "\n".join(bad)
