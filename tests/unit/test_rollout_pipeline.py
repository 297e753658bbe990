"""Bounded staleness's plan (rollout/pipeline.py): which steps' first generation batches are asked for
ahead, against timelines written out by hand from the rule (asked at the end of a step's rollout,
up to max_staleness steps ahead, never past a step that saves nor past the last step); what a stop
keeps of them; the lag metric; the settings around it."""

import dataclasses

import pytest

from megatron_dapo.config import DAPOConfig, RolloutConfig
from megatron_dapo.errors import ConfigError
from megatron_dapo.groups import Group, version_lag
from megatron_dapo.rollout.engine import Rollout
from megatron_dapo.rollout.partial import Carried
from megatron_dapo.rollout.pipeline import GenRequest, RolloutPipeline
from megatron_dapo.config_derived import ASYNC_TIS_CAP, derive
from megatron_dapo.trainer_state import TrainerState


def _asked(k: int, total: int, save_every: int) -> dict[int, list[int]]:
    pipe = RolloutPipeline(k, total, save_every)
    return {step: pipe.targets(step, finished=False) for step in range(total)}


# Steps from 0; record r = step + 1 saves when r % 3 == 0 (steps 2 and 5), 8 steps in all.
TIMELINE_K1 = {0: [1], 1: [2], 2: [], 3: [4], 4: [5], 5: [], 6: [7], 7: []}
TIMELINE_K2 = {0: [1, 2], 1: [], 2: [], 3: [4, 5], 4: [], 5: [], 6: [7], 7: []}


@pytest.mark.parametrize("k, timeline", [(1, TIMELINE_K1), (2, TIMELINE_K2)])
def test_batches_are_asked_for_ahead_as_the_recorded_timeline(k, timeline):
    assert _asked(k, 8, 3) == timeline


def test_lag_of_each_steps_first_batch_follows_from_the_timeline():
    # The batch of step t asked for in step s is generated from the weights after s steps and
    # trained by those after t: its lag is t - s (0 where the step drew its own).
    for k, timeline in ((1, TIMELINE_K1), (2, TIMELINE_K2)):
        lag = {t: t - s for s, targets in timeline.items() for t in targets}
        assert max(lag.values()) == k
        assert [lag.get(t, 0) for t in range(8)] == ([0, 1, 1, 0, 1, 1, 0, 1] if k == 1 else [0, 1, 2, 0, 1, 2, 0, 1])


def test_staleness_0_and_the_last_steps_ask_for_nothing():
    assert all(not t for t in _asked(0, 8, 0).values())
    assert _asked(3, 4, 0) == {0: [1, 2, 3], 1: [], 2: [], 3: []}
    pipe = RolloutPipeline(1, 8, 0)
    assert pipe.targets(0, finished=True) == []  # a generation budget spent: the run ends here


def test_take_hands_each_step_its_batch_in_order():
    pipe = RolloutPipeline(2, 8, 0)
    for t in pipe.targets(0, finished=False):
        pipe.add(GenRequest(t, [t], seed=t, request=t))
    assert pipe.take(0) is None  # step 0 drew its own
    assert pipe.take(1).request == 1 and pipe.take(1) is None and pipe.take(2).request == 2


def test_a_stop_keeps_the_collected_batches_and_a_resume_takes_them():
    pipe = RolloutPipeline(1, 8, 0)
    pipe.targets(0, finished=False)
    pipe.add(GenRequest(1, [5, 7], seed=11, request=1))
    with pytest.raises(RuntimeError, match=r"steps \[1\] are still in flight"):
        pipe.to_json()
    rollout = Rollout(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], finish_reason="stop", weight_version=4)
    pipe.ahead[0].rollouts = [[rollout], [rollout]]
    saved = TrainerState.from_json(TrainerState(step=1, sampler={}, ahead=tuple(pipe.to_json())).to_json(), "x")
    again = RolloutPipeline(1, 8, 0)
    again.restore(list(saved.ahead))
    got = again.take(1)
    assert (got.indices, got.seed, got.request, got.rollouts) == ([5, 7], 11, None, [[rollout], [rollout]])
    assert again.targets(1, finished=False) == [2]  # step 1's batch is not asked for twice


def test_a_checkpoint_without_batches_ahead_still_reads():
    data = TrainerState(step=3, sampler={}).to_json()
    del data["ahead"]
    assert TrainerState.from_json(data, "x").ahead == ()


def test_version_lag_is_measured_from_each_rollouts_version():
    def group(*versions):
        return Group(prompt_index=0, acc=[True] * len(versions), scores=[1.0] * len(versions),
                     rewards=[1.0] * len(versions),
                     rollouts=[Rollout(prompt_ids=[1], response_ids=[2], weight_version=v) for v in versions])
    assert version_lag([group(4, 4), group(3, 4)], 5) == {"rollout/version_lag_mean": 1.25,
                                                          "rollout/version_lag_max": 2.0}


@pytest.mark.parametrize("overrides, match", [
    (dict(max_staleness=1), "rollout.placement=separate"),
    (dict(max_staleness=-1, placement="separate", num_ranks=1), "must be >= 0"),
])
def test_staleness_settings_that_cannot_run_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        RolloutConfig(engine="hf", **overrides)


def test_stale_rollouts_cannot_be_their_own_pi_old():
    cfg = DAPOConfig()
    with pytest.raises(ConfigError, match="set train.old_log_probs=trainer"):
        dataclasses.replace(cfg, rollout=RolloutConfig(engine="hf", placement="separate", num_ranks=1, max_staleness=1),
                            train=dataclasses.replace(cfg.train, old_log_probs="rollout"))


def test_stale_rollouts_turn_tis_on_unless_chosen():
    sync = DAPOConfig()
    stale = dataclasses.replace(sync, rollout=RolloutConfig(engine="hf", placement="separate", num_ranks=1,
                                                            max_staleness=2))
    def corr(c):
        return c.algorithm.rollout_correction

    def with_async_defaults(c):
        return derive(c, on_gpu=False)[0]

    assert not corr(with_async_defaults(sync)).active
    assert (corr(with_async_defaults(stale)).rollout_is, corr(with_async_defaults(stale)).rollout_is_threshold) == \
        ("token", ASYNC_TIS_CAP)
    chosen = dataclasses.replace(stale, algorithm=dataclasses.replace(
        stale.algorithm, rollout_correction=dataclasses.replace(corr(stale), rollout_is="sequence")))
    assert corr(with_async_defaults(chosen)).rollout_is == "sequence"


def test_a_second_stop_collects_only_what_is_in_flight():
    # Resumed from a stop with steps 1 and 2 restored; step 1 taken; step 3 asked for; stopped again:
    # the restored step 2 keeps its rollouts (it has no request), step 3's are collected.
    pipe = RolloutPipeline(2, 8, 0)
    saved = GenRequest(2, [4], seed=2, rollouts=[[Rollout(prompt_ids=[1], response_ids=[2], weight_version=0)]])
    pipe.restore([GenRequest(1, [3], seed=1, rollouts=[]).to_json(), saved.to_json()])
    pipe.take(1)
    assert pipe.targets(1, finished=False) == [3]
    pipe.add(GenRequest(3, [5], seed=3, request=7))
    asked = []
    pipe.collect_in_flight(lambda request: asked.append(request) or [[]])
    assert asked == [7] and pipe.ahead[0].rollouts == saved.rollouts and pipe.to_json()


def test_a_run_that_ends_cancels_what_is_in_flight():
    pipe = RolloutPipeline(2, 8, 0)
    for t in pipe.targets(0, finished=False):
        pipe.add(GenRequest(t, [t], seed=t, request=t + 10))
    pipe.ahead[0].rollouts = []  # collected at a stop before a resume: nothing to cancel
    cancelled = []
    pipe.drop(cancelled.extend)  # the generation budget ran out at step 1: its final save finds nothing in flight
    assert cancelled == [12] and pipe.to_json() == []
    pipe.drop(cancelled.extend)  # nothing in flight: the engines are not asked
    assert cancelled == [12]


def test_nothing_is_asked_ahead_when_the_jobs_end_stops_the_run_after_the_next_step():
    import time

    from megatron_dapo.time_limit import StepClock
    from megatron_dapo.schedule import job_ends_after_next as _job_ends_after_next

    cfg = DAPOConfig()
    clock = StepClock()
    clock.load_state_dict({"step_seconds": [10.0, 10.0, 10.0], "save_seconds": 5.0, "eval_seconds": 20.0})
    margin, now = cfg.checkpoint.time_limit_margin_s, time.time()
    # this step's rest (10 s) + the next step (10 s) + its save (5 s) + the margin
    assert not _job_ends_after_next(cfg, clock, now + 25 + margin + 5, step=0, step_evaluates=False)
    assert _job_ends_after_next(cfg, clock, now + 25 + margin - 5, step=0, step_evaluates=False)
    assert _job_ends_after_next(cfg, clock, now + 25 + margin + 5, step=0, step_evaluates=True)  # + this step's eval
    assert not _job_ends_after_next(cfg, clock, None, step=0, step_evaluates=False)


def test_a_stop_releases_what_the_engines_cannot_finish_before_the_kill_and_a_resume_asks_again():
    """k=2, steps 2 and 3 in flight at a stop. The engines finished step 2's batch by the deadline
    (the placement's wait says 1: tests/unit/test_separate_waits.py); step 3's is released (saved
    without rollouts, no request; its request id goes to the engines to abort), restored as such, and
    asked for again: its prompts, seed and carried groups unchanged."""
    pipe = RolloutPipeline(2, 8, 0)
    pipe.add(GenRequest(2, [4, 5], seed=21, request=7))
    carried = Carried(9, [Rollout(prompt_ids=[1], response_ids=[2, 3], weight_version=1)])
    pipe.add(GenRequest(3, [6], seed=31, request=8, carried=[carried]))
    assert pipe.in_flight() == [7, 8]
    assert pipe.release(1) == [8] and pipe.in_flight() == [7]
    got = Rollout(prompt_ids=[1], response_ids=[4], weight_version=1)
    pipe.collect_in_flight(lambda request: [[got]] if request == 7 else pytest.fail("collected 8"))
    assert [a.rollouts for a in pipe.ahead] == [[[got]], None] and pipe.released() == [pipe.ahead[1]]
    saved = TrainerState.from_json(TrainerState(step=1, sampler={}, ahead=tuple(pipe.to_json())).to_json(), "x")
    assert [a["rollouts"] is None for a in saved.ahead] == [False, True]
    again = RolloutPipeline(2, 8, 0)
    again.restore(list(saved.ahead))
    assert again.take(2).rollouts == [[got]]
    (released,) = again.released()
    assert (released.indices, released.seed, released.carried, released.request) == ([6], 31, [carried], None)
    released.request = 12  # asked for again (train.py): in flight like any other, collected at the next stop
    assert not again.released() and again.in_flight() == [12]


def test_a_released_batch_is_asked_for_again_only_where_no_save_comes_before_it():
    """A resume may save more often than the run whose stop released a batch: asked for at the end
    of step 2 or 3, step 4's batch would be in flight at the save that ends step 3 (record 4), which
    then failed ("still in flight"). It is generated in its own step instead."""
    saved = [GenRequest(4, [1, 2], seed=3).to_json()]  # released: no rollouts, no request
    often, never = RolloutPipeline(2, 8, save_every=2), RolloutPipeline(2, 8, save_every=0)
    often.restore(saved)
    never.restore(saved)
    assert often.released(2) == often.released(3) == [] and len(often.released()) == 1
    assert [a.step for a in never.released(2)] == [4]
    assert often.take(4).indices == [1, 2]  # in its step: generated then, from the newest weights


def test_a_stop_whose_batches_all_finished_keeps_every_one():
    pipe = RolloutPipeline(1, 8, 0)
    pipe.add(GenRequest(2, [4], seed=2, request=3))
    assert pipe.release(1) == [] and pipe.in_flight() == [3]
    pipe.collect_in_flight(lambda request: [[]])
    assert pipe.in_flight() == [] and pipe.to_json()[0]["rollouts"] == [[]]


def _held_and_lag(k: int, steps: int, *, ahead_size) -> tuple[int, int]:
    """The training loop's rollout (train.py) over the real DynamicSampler and RolloutPipeline:
    8 prompts a step, generation batches of 16 of which 60% are mixed (seeded), surplus="carry".
    A batch's groups hold the step whose weights generated it. (most groups held after a step, the
    largest lag trained)."""
    import random

    import torch

    from megatron_dapo.algo.dynamic_sampling import DynamicSampler

    rng, pps, size = random.Random(0), 8, 16
    dyn = DynamicSampler(prompts_per_step=pps, group_size=4, max_num_gen_batches=0, surplus="carry")
    pipeline, versions = RolloutPipeline(k, steps, 0), {}  # a batch's version, by its first step
    most, lag = 0, 0
    for step in range(steps):
        dyn.start_step()
        while not dyn.is_full or pipeline.has(step):
            ahead = pipeline.take(step) or GenRequest(step, list(range(size)), 0)
            acc = torch.tensor([[rng.random() < 0.6, False, False, False] for _ in ahead.indices])
            dyn.add([versions.pop(step, step) if ahead.request else step] * len(ahead.indices), acc)
        groups, _ = dyn.pop()
        lag = max(lag, max(step - v for v in groups))
        for target in pipeline.targets(step, finished=step + 1 == steps):
            prompts = ahead_size(dyn, size, target - step)
            if prompts:
                versions[target] = step - 1  # asked for now: the weights of the step before
                pipeline.add(GenRequest(target, list(range(prompts)), 0, request=target))
        most = max(most, len(dyn.held))
    return most, lag


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batches_asked_for_ahead_keep_the_held_groups_and_their_lag_bounded(k):
    """Two or more steps ahead a batch was asked for at full size whatever the groups held
    (surplus="carry", as partial rollouts force): every step took its batch, held more than it
    trained, and the held groups and their lag grew with the run (k=2: 49 held and a lag of 9 after
    30 steps, 306 and 37 after 200). Asked for by what the held groups leave uncovered, both stay
    bounded: at most k steps' groups and one batch held, a lag of at most 2k + 3."""
    def old_rule(dyn, size, ahead):
        return 0 if ahead == 1 and dyn.is_full else dyn.request_size(size)

    def rule(dyn, size, ahead):
        return dyn.ahead_request_size(size, ahead)

    for steps in (30, 200):
        most, lag = _held_and_lag(k, steps, ahead_size=rule)
        assert most <= k * 8 + 16 and lag <= 2 * k + 3, (steps, most, lag)
    if k >= 2:
        most, lag = _held_and_lag(k, 200, ahead_size=old_rule)
        assert most > 100 and lag > 20  # the rule it replaces, for the record
