"""The toy task: deterministic, disjoint splits, ground truths that really answer the questions."""

import re
from collections import Counter

import pytest

from megatron_dapo.data import load_prompts
from megatron_dapo.reward import compute_score
from megatron_dapo.toy import task as toy_task


@pytest.fixture(scope="module")
def splits():
    return toy_task.make_splits(seed=3, num_train=700, num_val=128, num_digits=5)


def test_same_seed_same_rows_other_seed_other_rows(splits):
    assert toy_task.make_splits(seed=3, num_train=700, num_val=128, num_digits=5) == splits
    other = toy_task.make_splits(seed=4, num_train=700, num_val=128, num_digits=5)
    assert [r["prompt"] for r in other[1]] != [r["prompt"] for r in splits[1]]


def test_validation_does_not_depend_on_the_train_size(splits):
    _, val = toy_task.make_splits(seed=3, num_train=50, num_val=128, num_digits=5)
    assert val == splits[1]


def test_ground_truth_is_the_largest_digit_of_the_question(splits):
    # Independent of the generator: read the digit string back out of the prompt text.
    for row in splits[0] + splits[1]:
        content = row["prompt"][0]["content"]
        digits = re.search(r"(\d+)\?$", content).group(1)
        assert len(digits) == 5
        assert row["reward_model"]["ground_truth"] == max(digits)
        assert toy_task.parse_question(content) == [int(d) for d in digits]


def test_rows_use_the_dapo_schema(splits):
    row = splits[0][0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "toy"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["raw_problem"]}]
    assert isinstance(row["reward_model"]["ground_truth"], str)


def test_splits_are_unique_and_disjoint(splits):
    train = [r["prompt"][0]["content"] for r in splits[0]]
    val = [r["prompt"][0]["content"] for r in splits[1]]
    assert len(set(train)) == len(train) and len(set(val)) == len(val)
    assert not set(train) & set(val)


def test_answers_are_uniform_so_no_constant_answer_wins(splits):
    counts = Counter(r["reward_model"]["ground_truth"] for r in splits[0])
    assert sorted(counts) == [str(a) for a in range(toy_task.MIN_ANSWER, 10)]
    expected = len(splits[0]) / len(counts)
    assert all(0.7 * expected < n < 1.3 * expected for n in counts.values()), counts
    assert max(counts.values()) / len(splits[0]) < 0.2  # the best constant answer is far below 0.8


def test_too_many_problems_for_the_digit_count_is_an_error():
    with pytest.raises(ValueError, match="too many"):
        toy_task.make_splits(seed=0, num_train=5000, num_val=100, num_digits=3)


def test_parquet_files_load_through_the_project_loader(tmp_path):
    train_path, val_path = toy_task.write_toy_dataset(tmp_path, seed=1, num_train=40, num_val=16,
                                                      num_digits=5)
    train = load_prompts(train_path)
    val = load_prompts(val_path)
    assert len(train.records) == 40 and len(val.records) == 16 and train.num_skipped == 0
    record = train.records[0]
    assert record.data_source == "toy" and record.ground_truth.isdigit()
    assert record.chat()[0]["content"].startswith("Largest digit of ")


@pytest.mark.parametrize("reasoning", [False, True])
def test_the_taught_format_is_scored_by_the_real_reward_fn(reasoning):
    digits = [3, 7, 1, 9, 4]
    right = toy_task.format_response(digits, 9, reasoning=reasoning)
    wrong = toy_task.format_response(digits, 4, reasoning=reasoning)
    assert right.splitlines()[-1] == "Answer: 9"
    assert compute_score(right, "9") == {"score": 1.0, "acc": True, "pred": "9"}
    assert compute_score(wrong, "9")["acc"] is False


def test_lengths_vary_uniformly_and_problems_stay_unique_and_disjoint():
    train, val = toy_task.make_splits(seed=3, num_train=2000, num_val=128, num_digits=12, min_digits=4)
    digits = [toy_task.parse_question(r["prompt"][0]["content"]) for r in train + val]
    assert len({tuple(d) for d in digits}) == len(digits)
    counts = Counter(len(d) for d in digits)
    assert sorted(counts) == list(range(4, 13))
    assert max(counts.values()) < 1.5 * min(counts.values())  # ~236 each
    assert all(int(r["reward_model"]["ground_truth"]) == max(d) for r, d in zip(train + val, digits))


def test_a_fixed_length_draws_the_same_data_as_before_lengths_could_vary():
    fixed = toy_task.make_splits(seed=3, num_train=50, num_val=16, num_digits=5)
    assert toy_task.make_splits(seed=3, num_train=50, num_val=16, num_digits=5, min_digits=5) == fixed
    assert fixed[1][0]["prompt"][0]["content"] == "Largest digit of 00730?"  # pinned before min_digits existed


@pytest.mark.parametrize("min_digits", [1, 6])
def test_bad_min_digits_is_refused(min_digits):
    with pytest.raises(ValueError, match="min_digits"):
        toy_task.make_splits(seed=0, num_train=10, num_val=4, num_digits=5, min_digits=min_digits)
