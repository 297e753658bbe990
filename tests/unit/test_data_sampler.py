"""PromptSampler: epoch permutations, determinism, and exact resume from a saved state."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.data import PromptSampler


def draw(sampler, ks):
    out = []
    for k in ks:
        out.extend(sampler.next_indices(k))
    return out


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(20, seed=3)
    stream = draw(sampler, [7] * 9)  # 63 indices: epochs 0, 1, 2 and 3 of epoch 3
    epochs = [stream[0:20], stream[20:40], stream[40:60]]
    for order in epochs:
        assert sorted(order) == list(range(20))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(20))
    assert (sampler.consumed, sampler.epoch) == (63, 3)


def test_same_seed_same_stream_and_chunking_does_not_matter():
    a = draw(PromptSampler(17, seed=11), [5, 0, 12, 30, 1])
    b = draw(PromptSampler(17, seed=11), [48])
    assert a == b and len(a) == 48


def test_different_seeds_differ_even_shifted_by_one_epoch():
    n = 50
    seed0 = PromptSampler(n, seed=0).next_indices(2 * n)
    seed1 = PromptSampler(n, seed=1).next_indices(2 * n)
    assert seed0[:n] != seed1[:n]
    # seed + epoch seeding would make seed 1's epoch 0 equal seed 0's epoch 1.
    assert seed1[:n] != seed0[n:]


def test_no_shuffle_is_sequential():
    sampler = PromptSampler(4, seed=0, shuffle=False)
    assert sampler.next_indices(10) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert sampler.epoch == 2


def test_single_item_and_zero_draw():
    sampler = PromptSampler(1, seed=5)
    assert sampler.next_indices(0) == []
    assert sampler.next_indices(3) == [0, 0, 0]
    assert (sampler.consumed, sampler.epoch) == (3, 3)


@settings(max_examples=150, deadline=None)
@given(num_items=st.integers(1, 40), seed=st.integers(0, 2**32), shuffle=st.booleans(),
       ks=st.lists(st.integers(0, 90), max_size=12), data=st.data())
def test_resume_equals_uninterrupted(num_items, seed, shuffle, ks, data):
    cut = data.draw(st.integers(0, len(ks)))
    uninterrupted = draw(PromptSampler(num_items, seed=seed, shuffle=shuffle), ks)

    first = PromptSampler(num_items, seed=seed, shuffle=shuffle)
    before = draw(first, ks[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = PromptSampler(num_items, seed=seed, shuffle=shuffle)
    resumed.load_state_dict(state)
    assert (resumed.consumed, resumed.epoch) == (first.consumed, first.epoch)
    after = draw(resumed, ks[cut:])

    assert before + after == uninterrupted
    # Independent check of the stream: epoch e is a permutation of range(num_items).
    for start in range(0, len(uninterrupted) - num_items + 1, num_items):
        assert sorted(uninterrupted[start:start + num_items]) == list(range(num_items))


def test_state_dict_is_plain():
    sampler = PromptSampler(9, seed=4)
    sampler.next_indices(13)
    assert sampler.state_dict() == {"num_items": 9, "seed": 4, "shuffle": True, "consumed": 13}


@pytest.mark.parametrize("change, match", [
    ({"num_items": 10}, "num_items=10 but this sampler has num_items=9"),
    ({"seed": 5}, "seed=5 but this sampler has seed=4"),
    ({"shuffle": False}, "shuffle=False"),
    ({"consumed": -1}, "consumed"),
    ({"extra": 1}, "keys"),
])
def test_load_state_dict_rejects_mismatches(change, match):
    state = {**PromptSampler(9, seed=4).state_dict(), **change}
    with pytest.raises(ValueError, match=match):
        PromptSampler(9, seed=4).load_state_dict(state)


def test_argument_validation():
    with pytest.raises(ValueError, match="num_items"):
        PromptSampler(0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(3, seed=-1)
    with pytest.raises(ValueError, match="k must be"):
        PromptSampler(3, seed=0).next_indices(-1)
