"""Advantages, overlong shaping and dynamic sampling against hand-computed values."""

import numpy as np
import pytest
import torch

from megatron_dapo.algo import (
    DynamicSampler,
    DynamicSamplingExhausted,
    compute_grpo_advantages,
    get_advantage_fn,
    overlong_filter_mask,
    overlong_penalty,
)
from megatron_dapo.registry import Registry


def test_grpo_advantages_hand_computed():
    # Group [1, -1, -1, -1]: mean -0.5, unbiased std sqrt(((1.5)^2 + 3 * 0.5^2) / 3) = 1.
    adv = compute_grpo_advantages(torch.tensor([[1.0, -1.0, -1.0, -1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]) / (1.0 + 1e-6))


def test_grpo_advantages_match_numpy_ddof1():
    rewards = torch.randn(7, 16, dtype=torch.float64)
    r = rewards.numpy()
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(compute_grpo_advantages(rewards).numpy(), expected, rtol=1e-12)


def test_equal_group_gets_zeros():
    # For -3.7971909 (float32) the mean of 8 copies is off by an ulp, and the naive formula gives
    # |advantage| 0.19 for a group with no signal at all.
    odd = torch.full((8,), -3.7971909046173096)
    assert ((odd - odd.mean()) / (odd.std() + 1e-6)).abs().max() > 0.1  # the trap is real
    rewards = torch.stack([torch.full((8,), 1.0), torch.full((8,), -1.0), odd])
    for fn in ("grpo", "grpo_mean_only"):
        assert torch.equal(get_advantage_fn(fn)(rewards), torch.zeros(3, 8))


def test_group_size_one_is_rejected():
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_grpo_advantages(torch.ones(4, 1))


def test_advantage_registry():
    assert get_advantage_fn("grpo") is compute_grpo_advantages
    mean_only = get_advantage_fn("grpo_mean_only")(torch.tensor([[3.0, 1.0]]))
    assert mean_only.tolist() == [[1.0, -1.0]]
    with pytest.raises(ValueError, match=r"valid names: \['grpo', 'grpo_mean_only'\]"):
        get_advantage_fn("gae")


def test_registry_refuses_shadowing_without_touching_global_ones():
    reg = Registry("thing")
    reg.register("a")(len)
    reg.register("a")(len)  # same object twice is fine (re-import)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (16384, 0.0),                # up to L_max - L_cache: no penalty
    (16385, -1 / 4096), (18432, -0.5),     # linear ramp
    (20480, -1.0), (25000, -1.0),          # at and beyond L_max: -1
])
def test_overlong_penalty_eq13(length, expected):
    got = overlong_penalty(torch.tensor([length]), max_response_len=20480, buffer_len=4096)
    assert got.item() == pytest.approx(expected, abs=1e-7)


def test_overlong_penalty_factor_and_bad_buffer():
    got = overlong_penalty(torch.tensor([18432, 20480]), max_response_len=20480, buffer_len=4096,
                           penalty_factor=0.5)
    assert got.tolist() == [-0.25, -0.5]
    with pytest.raises(ValueError, match="buffer_len=5000, max_response_len=4096"):
        overlong_penalty(torch.tensor([1]), max_response_len=4096, buffer_len=5000)


def test_overlong_filter_mask():
    assert overlong_filter_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]


def _acc(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_dynamic_sampling_fills_across_batches_and_counts_add_up():
    s = DynamicSampler(prompts_per_step=3, group_size=2, max_num_gen_batches=5)
    s.start_step()
    s.add(["a", "b", "c"], _acc([[1, 1], [1, 0], [0, 0]]))  # keep b
    assert not s.is_full
    keep = s.add(["d", "e", "f"], _acc([[0, 1], [1, 0], [1, 1]]))  # keep d, e -> full
    assert keep.tolist() == [True, True, False]
    batch, m = s.pop()
    assert batch == ["b", "d", "e"]
    assert m["dynamic_sampling/num_gen_batches"] == 2
    assert m["dynamic_sampling/num_groups_kept"] == 3
    assert m["dynamic_sampling/num_dropped_all_correct"] == 2
    assert m["dynamic_sampling/num_dropped_all_wrong"] == 1
    generated = m["dynamic_sampling/num_groups_generated"]
    assert generated == 6 == (m["dynamic_sampling/num_groups_kept"] + m["dynamic_sampling/num_dropped_all_correct"]
                              + m["dynamic_sampling/num_dropped_all_wrong"])
    assert m["dynamic_sampling/responses_per_used_response"] == 2.0  # 12 generated / 6 used
    assert m["dynamic_sampling/mean_pass_rate"] == pytest.approx(7 / 12)  # 2+1+0+1+1+2 correct of 12


def test_surplus_drop_vs_carry():
    for surplus, carried in (("drop", []), ("carry", ["c", "d"])):
        s = DynamicSampler(prompts_per_step=2, group_size=2, max_num_gen_batches=0, surplus=surplus)
        s.start_step()
        s.add(["a", "b", "c", "d"], _acc([[1, 0]] * 4))
        batch, m = s.pop()
        assert batch == ["a", "b"]
        assert list(s.held) == carried
        s.start_step()
        assert s.is_full == (surplus == "carry")
        key = "carried" if surplus == "carry" else "dropped"
        assert m[f"dynamic_sampling/num_surplus_{key}"] == 2


def test_an_exhausted_step_fills_from_the_last_batchs_dropped_groups(caplog):
    """on_exhausted=fill: the last allowed batch carries its dropped groups, and the first of them
    complete the step, counted and logged; without enough of them it still raises."""
    s = DynamicSampler(prompts_per_step=3, group_size=2, max_num_gen_batches=2, on_exhausted="fill")
    s.start_step()
    assert not s.carries_all()  # the first of two batches: dropped groups need not travel
    s.add(["a", None, None], _acc([[1, 0], [1, 1], [0, 0]]))
    assert s.carries_all()
    with caplog.at_level("WARNING"):
        keep = s.add(["d", "e", "f"], _acc([[0, 1], [1, 1], [0, 0]]))
    assert keep.tolist() == [True, False, False]  # the filter's verdict is unchanged
    batch, m = s.pop()
    assert batch == ["a", "d", "e"] and m["dynamic_sampling/num_filled"] == 1.0
    assert "max_num_gen_batches=2" in caplog.text and "Filled the other 1 slots" in caplog.text
    s.start_step()
    s.add(["g", None, None], _acc([[1, 1], [1, 1], [1, 1]]))
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches=2"):
        s.add(["h", None, None], _acc([[1, 1], [1, 1], [1, 1]]))  # one spare for three missing
    strict = DynamicSampler(prompts_per_step=3, group_size=2, max_num_gen_batches=1, on_exhausted="error")
    strict.start_step()
    assert not strict.carries_all()
    with pytest.raises(DynamicSamplingExhausted):
        strict.add(["a", "b", "c"], _acc([[1, 0], [1, 1], [0, 0]]))


def test_a_filled_step_counts_its_mixed_groups_before_the_fill(caplog):
    """The warning of a filled step counts the mixed groups found, not the slots filled (a step
    that found none would read as full), and says what filled the rest and what that means."""
    s = DynamicSampler(prompts_per_step=2, group_size=2, max_num_gen_batches=1, on_exhausted="fill")
    s.start_step()
    with caplog.at_level("WARNING"):
        s.add(["a", "b", "c"], _acc([[1, 1], [0, 0], [0, 0]]))
    text = caplog.text
    assert "collected 0 of 2 mixed prompt groups" in text, text
    assert "Filled the other 2 slots" in text and "(1 all correct, 1 all wrong)" in text, text
    assert "this step learns nothing about correctness" in text and "max_num_gen_batches (0 = unbounded)" in text, text
    assert len(text.strip().splitlines()) == 1, text
    assert s.pop()[0] == ["a", "b"]
    caplog.clear()
    s.start_step()
    with caplog.at_level("WARNING"):
        s.add(["d", "e", "f"], _acc([[0, 1], [1, 1], [1, 1]]))
    assert "collected 1 of 2 mixed" in caplog.text and "learns correctness only from its 1 mixed groups" in caplog.text
    assert "The data is too easy" in caplog.text, caplog.text


def test_exhausted_error_names_the_numbers():
    s = DynamicSampler(prompts_per_step=4, group_size=4, max_num_gen_batches=2)
    s.start_step()
    s.add(["a", "b"], _acc([[1, 1, 1, 1], [0, 1, 0, 0]]))
    with pytest.raises(DynamicSamplingExhausted) as e:
        s.add(["c", "d"], _acc([[0, 0, 0, 0], [0, 0, 0, 0]]))
    msg = str(e.value)
    for part in ("collected 1 of 4", "after 2 generation batches", "max_num_gen_batches=2",
                 "1 groups were all correct and 2 all wrong", "0/4 correct: 2", "1/4 correct: 1",
                 "4/4 correct: 1", "0 = unbounded"):
        assert part in msg


def test_unbounded_and_disabled():
    s = DynamicSampler(prompts_per_step=1, group_size=2, max_num_gen_batches=0)
    s.start_step()
    for _ in range(50):
        s.add(["x"], _acc([[0, 0]]))
    s.add(["y"], _acc([[0, 1]]))
    assert s.pop()[0] == ["y"]
    off = DynamicSampler(prompts_per_step=2, group_size=2, max_num_gen_batches=1, enabled=False)
    off.start_step()
    off.add(["a", "b"], _acc([[1, 1], [0, 0]]))
    batch, m = off.pop()
    assert batch == ["a", "b"] and m["dynamic_sampling/num_dropped_all_correct"] == 0


def test_bad_acc_shape():
    s = DynamicSampler(prompts_per_step=1, group_size=3, max_num_gen_batches=0)
    with pytest.raises(ValueError, match=r"acc must be \[2, 3\]"):
        s.add(["a", "b"], _acc([[1, 0], [0, 1]]))


def test_adaptive_batches_are_sized_by_the_measured_keep_rate():
    import torch

    s = DynamicSampler(prompts_per_step=8, group_size=2, max_num_gen_batches=0, adaptive=True)
    assert s.request_size(12) == 12  # nothing measured yet: the fixed size
    mixed, same = [True, False], [True, True]
    s.start_step()
    s.add([object()] * 10, torch.tensor([mixed] * 4 + [same] * 6))  # 4 of 10 kept
    assert s.keep_rate == 0.4
    assert s.request_size(12) == 11  # 4 missing: 4 x 1.1 / 0.4 = 11
    s.add([object()] * 10, torch.tensor([mixed] * 2 + [same] * 8))  # 2 of 10: the estimate halves towards it
    assert s.keep_rate == pytest.approx(0.3)
    assert s.request_size(12) == 8  # 2 missing: 2 / 0.3 x 1.1 = 7.33 -> 8
    s.add([object()] * 2, torch.tensor([same] * 2))  # none kept: 0.15
    assert s.request_size(12) == 15  # 14.67 -> 15, under the cap of 4 x 12
    s.add([object()] * 4, torch.tensor([same] * 4))  # 0.075: 29.3, still under 48
    s.add([object()] * 4, torch.tensor([same] * 4))  # 0.0375: 58.7, capped
    assert s.request_size(12) == 48
    capped = DynamicSampler(prompts_per_step=8, group_size=2, max_num_gen_batches=0, adaptive=True, max_request=20)
    capped.add([object()], torch.tensor([same]))
    assert capped.keep_rate == 0.0 and capped.request_size(12) == 20
    fixed = DynamicSampler(prompts_per_step=4, group_size=2, max_num_gen_batches=0)  # adaptive off
    fixed.add([object()] * 10, torch.tensor([mixed] * 4 + [same] * 6))
    assert fixed.request_size(12) == 12 and "dynamic_sampling/keep_rate_estimate" not in fixed.pop()[1]
    restored = DynamicSampler(prompts_per_step=8, group_size=2, max_num_gen_batches=0, adaptive=True)
    restored.restore_held([], keep_rate=0.5)
    assert restored.request_size(12) == 18  # 8 / 0.5 x 1.1 = 17.6
