"""The paper's scoring rule (reward/paper_rule.py) beside ours (reward/math_dapo.py) on one labelled
table, the scorer registry, and a RewardPool that holds both."""

import pytest

from megatron_dapo.reward import PAPER_REWARD_FN, VALUE_REWARD_FN, RewardPool, get_reward_fn, paper_rule
from megatron_dapo.reward.labelled_cases import CASES, SCORER_CASES

paper = get_reward_fn(PAPER_REWARD_FN)
ours = get_reward_fn(VALUE_REWARD_FN)


@pytest.mark.parametrize("response, ground_truth, paper_acc, ours_acc, label", SCORER_CASES,
                         ids=[c[-1] for c in SCORER_CASES])
def test_labelled_table(response, ground_truth, paper_acc, ours_acc, label):
    p, o = paper(response, ground_truth), ours(response, ground_truth)
    assert p["acc"] is paper_acc, f"paper rule on {label}: {p}"
    assert o["acc"] is ours_acc, f"ours on {label}: {o}"
    for result in (p, o):
        assert set(result) == {"score", "acc", "pred"}
        assert result["score"] == (1.0 if result["acc"] else -1.0)


def test_table_covers_the_issue_differences():
    differ = {label for *_, pa, oa, label in SCORER_CASES if pa != oa}
    assert {"markdown bold label", "trailing period", "frac of the value", "leading zero",
            "answer followed by > 300 characters"} <= differ
    agree = {label for *_, pa, oa, label in SCORER_CASES if pa == oa}
    assert {"unit mph", "unit edges", "unit pounds"} <= agree  # the units ours now knows


@pytest.mark.parametrize("raw, normalised", [
    ("42", "42"),
    ("**42", "**42"),  # markdown is not removed
    ("42.", "42."),
    ("$42$", "42"),
    ("x = 42", "42"),  # text after the last "="
    ("1,000", "1000"),
    ("1,000.5", "1,000.5"),  # commas go only when digits remain
    ("42 pounds", "42"),
    ("\\text{42 cm}", "42"),
    ("\\boxed{42}", "42"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\overline{3}", "3"),
    ("a 42", "42"),  # "a " is a substitution
    ("The answer is 42", "Theansweris42"),
    ("$x$ and then $42$", "x"),  # the first $...$ pair
])
def test_paper_normalisation(raw, normalised):
    assert paper_rule.normalize_final_answer(raw) == normalised


def test_paper_rule_pred_and_tail():
    assert paper("no answer", "42")["pred"] == "[INVALID]"
    assert paper("Answer: 42", 42)["acc"]  # an int ground truth is read as its string
    assert not paper("Answer: 42" + "x" * 300, "42")["acc"]  # the label is cut off by the 300-character tail
    assert paper("x" * 1000 + "Answer: 42", "42")["acc"]


def test_pool_scores_with_each_named_fn():
    responses, truths, want_paper, want_ours, _ = map(list, zip(*SCORER_CASES))
    with RewardPool(num_workers=1, timeout_s=10.0, score_fn=ours,
                    score_fns={PAPER_REWARD_FN: paper, VALUE_REWARD_FN: ours}) as pool:
        assert [r["acc"] for r in pool.score(responses, truths, fn=PAPER_REWARD_FN)] == want_paper
        assert [r["acc"] for r in pool.score(responses, truths)] == want_ours
        assert [r["acc"] for r in pool.score(responses, truths, fn=VALUE_REWARD_FN)] == want_ours
        with pytest.raises(ValueError, match="no score fn 'nope'"):
            pool.score(responses, truths, fn="nope")
    with RewardPool(num_workers=0, timeout_s=1.0, score_fns={PAPER_REWARD_FN: paper}) as pool:  # inline mode
        assert [r["acc"] for r in pool.score(responses, truths, fn=PAPER_REWARD_FN)] == want_paper


def _verl_090_reads_the_same(response: str) -> bool:
    """verl <= 0.9.0's math_dapo, which paper_rule.py follows, reads only the "Answer:" line; 0.9.1
    also falls back to the last \\boxed{} of the 300-character tail when that line is missing."""
    return paper_rule.extract_answer(response) != paper_rule.INVALID or "\\boxed{" not in response[-300:]


ALL_RESPONSES = [(c[0], c[1]) for c in SCORER_CASES + CASES]


@pytest.mark.parametrize("response, ground_truth", ALL_RESPONSES, ids=[str(i) for i in range(len(ALL_RESPONSES))])
def test_paper_rule_equals_verl_091_but_for_its_boxed_fallback(response, ground_truth):
    """verl 0.9.1's math_dapo.compute_score as shipped: the same score and prediction wherever it reads the
    "Answer:" line as verl <= 0.9.0 did; where it falls back to \\boxed{}, the prediction is the box's."""
    from tests.helpers.verl_reference import verl
    _, math_dapo, _ = verl()
    theirs, ours = math_dapo.compute_score(response, ground_truth), paper_rule.compute_score(response, ground_truth)
    if _verl_090_reads_the_same(response):
        assert (theirs["score"], theirs["pred"]) == (ours["score"], ours["pred"])
    else:
        assert ours["pred"] == paper_rule.INVALID and theirs["pred"] != paper_rule.INVALID


def test_verl_091_boxed_fallback_is_the_one_difference():
    """A response with \\boxed{42} and no "Answer:" line: 0.9.0's rule (ours) scores it wrong, 0.9.1 right."""
    from tests.helpers.verl_reference import verl
    _, math_dapo, _ = verl()
    response = "Let me think. The sum is $\\boxed{42}$."
    assert paper_rule.compute_score(response, "42")["score"] == -1.0
    assert math_dapo.compute_score(response, "42")["score"] == 1.0
