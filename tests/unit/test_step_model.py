"""The step model (megatron_dapo/step_model.py) against timelines worked out by hand and a step-by-step
decode simulation written here independently."""

import random

import pytest

from megatron_dapo.step_model import (
    StepWork,
    colocated,
    continuous_batching_seconds,
    separate,
)


def test_staleness_0_overlaps_nothing_and_equals_colocated():
    work = [StepWork((2.0, 1.5), score=0.25, train=1.0), StepWork((3.0,), score=0.25, train=2.0)]
    assert separate(work, max_staleness=0).step_s == colocated(work).step_s == (5.0, 5.25)


def test_staleness_1_as_worked_out_by_hand():
    # step 0: asks and waits for its batch (0-2), asks ahead for step 1's (engines 2-4), trains to 3,
    # waits for that batch to end before its weights go in (3-4); step 1: takes it at once, asks for
    # step 2's (4-6), trains to 5, waits until 6; step 2: takes it, trains to 7 (the last step asks
    # for nothing, so nothing is queued when it sends).
    t = separate([StepWork((2.0,), score=0.0, train=1.0)] * 3, max_staleness=1)
    assert t.step_s == (4.0, 2.0, 1.0)
    assert t.trainer_waited_s == 4.0 and t.engines_idle_s == 1.0  # the engines: idle from 6 to 7


def test_a_further_batch_waits_behind_the_weights_load():
    # step 0's weights go in once the batch asked ahead has ended (4), loaded 4-4.5; step 1's second
    # batch, asked at 4 (its first was done), runs after the load, 4.5-5.5; step 1 trains 5.5-6.5.
    work = [StepWork((2.0,), score=0.0, train=1.0, load=0.5), StepWork((2.0, 1.0), score=0.0, train=1.0, load=0.5)]
    t = separate(work, max_staleness=1)
    assert t.step_s == (4.0, 2.5)


def test_staleness_2_adds_lag_not_overlap():
    # The weights of a step go in after every batch asked before them, so at k = 2 the trainers still
    # wait for the batches asked for in the same step: the steady steps are k = 1's (2 s), and step 0
    # waits for two batches ahead (2-6) instead of one.
    work = [StepWork((2.0,), score=0.0, train=1.0)] * 6
    one, two = separate(work, max_staleness=1), separate(work, max_staleness=2)
    assert two.step_s[1:4] == one.step_s[1:4] == (2.0, 2.0, 2.0)
    assert two.step_s[0] == 6.0 and two.total_s > one.total_s


def test_a_save_drains_the_pipeline():
    work = [StepWork((2.0,), score=0.0, train=1.0)] * 3
    # save_every=1: every step saves, nothing is asked ahead: the synchronous timeline
    assert separate(work, max_staleness=1, save_every=1).step_s == colocated(work).step_s


def _decode_by_steps(lengths, *, slots, weights_step_s, kv_step_s_per_token, prompt_tokens, prefixes=None):
    """One decode step at a time: start queued sequences in order into free slots, pay the weights
    and every live sequence's context, advance each by a token."""
    prefixes = prefixes or [0] * len(lengths)
    queue, live, seconds = list(zip(lengths, prefixes)), [], 0.0  # live: [generated so far, length, prefix]
    while queue or live:
        while queue and len(live) < slots:
            length, prefix = queue.pop(0)
            live.append([0, length, prefix])
        seconds += weights_step_s + kv_step_s_per_token * sum(prompt_tokens + p + g for g, _, p in live)
        for seq in live:
            seq[0] += 1
        live = [s for s in live if s[0] < s[1]]
    return seconds


@pytest.mark.parametrize("slots", [1, 3, 8, 50])
def test_continuous_batching_equals_a_step_by_step_decode(slots):
    rng = random.Random(slots)
    lengths = [rng.randint(1, 60) for _ in range(40)]
    args = dict(slots=slots, weights_step_s=0.01, kv_step_s_per_token=0.0003, prompt_tokens=7)
    assert continuous_batching_seconds(lengths, **args) == pytest.approx(_decode_by_steps(lengths, **args))
    prefixes = [rng.choice([0, 16, 32]) for _ in lengths]  # partial rollouts' continued responses
    assert continuous_batching_seconds(lengths, prefixes=prefixes, **args) == pytest.approx(
        _decode_by_steps(lengths, prefixes=prefixes, **args))
