"""Partial rollouts (rollout/partial.py): a batch's items and how its outputs merge into complete and
carried groups, written out by hand; continuation against the engine's own one-shot generation
(the HF engine on a tiny Qwen2: greedy pieces give the same tokens, the same finish and the same
log-probs as one call); the settings, refusals and saved state around it."""

import dataclasses

import pytest
import torch

from megatron_dapo.config import DAPOConfig, RolloutConfig, TrainConfig
from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout.engine import Rollout
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.partial import (
    Carried, engine_inputs, is_cut, partial_metrics, split_complete, token_versions,
)
from megatron_dapo.rollout.pipeline import GenRequest
from megatron_dapo.config_derived import ASYNC_TIS_CAP, derive
from megatron_dapo.launch_checks import check_rollout
from megatron_dapo.trainer_state import TrainerState
from tests.helpers.rollout import VOCAB, tiny_qwen2

MAX = 12


def _r(prompt, response, finish="length", version=0, pieces=()):
    return Rollout(prompt_ids=list(prompt), response_ids=list(response), logprobs=[-0.5] * len(response),
                   finish_reason=finish, weight_version=version, pieces=[list(p) for p in pieces])


def test_items_are_the_new_prompts_n_times_then_every_cut_prefix():
    carried = [Carried(7, [_r([1], [2, 3, 4, 5]), _r([1], [6], "stop")]),
               Carried(9, [_r([8], [1, 1, 1, 1]),
                           _r([8], [2, 2, 2, 2, 3, 3, 3, 3], version=1, pieces=[[0, 4], [1, 4]])])]
    prompts = {0: [10], 1: [11, 12], 2: [13]}
    assert engine_inputs(prompts, [2, 0], 2, carried, MAX) == [
        [13], [13], [10], [10],  # new prompts in draw order, n each
        [1, 2, 3, 4, 5], [8, 1, 1, 1, 1], [8, 2, 2, 2, 2, 3, 3, 3, 3]]  # the cut ones, in carry order
    assert not is_cut(_r([1], [6] * MAX), MAX)  # at the limit: finished ("length", truncated)


def test_merge_extends_the_cut_responses_and_splits_complete_from_carried():
    carried = [Carried(7, [_r([1], [2, 3, 4, 5]), _r([1], [6], "stop")]),
               Carried(9, [_r([8], [1, 1, 1, 1]), _r([8], [2, 2, 2, 2], version=0)])]
    outputs = [[_r([13], [4], "stop", 2)], [_r([13], [5, 5, 5, 5], "length", 2)],  # new prompt 2: one cut
               [_r([], [9], "stop", 2)],  # group 7's cut response ends
               [_r([], [1, 1, 1, 1], "length", 2)], [_r([], [3], "stop", 2)]]  # group 9: one goes on
    complete, carry = split_complete([2], 2, carried, outputs, MAX)
    assert [g.prompt_index for g in complete] == [7] and [g.prompt_index for g in carry] == [9, 2]
    done = complete[0].rollouts[0]
    assert (done.prompt_ids, done.response_ids, done.finish_reason) == ([1], [2, 3, 4, 5, 9], "stop")
    assert done.weight_version == 0 and done.pieces == [[0, 4], [2, 1]] and len(done.logprobs) == 5
    assert complete[0].rollouts[1].response_ids == [6] and complete[0].rollouts[1].pieces == []
    assert token_versions(done) == [0, 0, 0, 0, 2]
    assert carry[0].rollouts[0].response_ids == [1] * 8 and is_cut(carry[0].rollouts[0], MAX)
    assert carry[1].rollouts[0].finish_reason == "stop" and is_cut(carry[1].rollouts[1], MAX)
    assert carried[0].rollouts[0].response_ids == [2, 3, 4, 5]  # the batch's own carry is left as it was
    with pytest.raises(ValueError, match="4 outputs for a batch of 1 new prompts x 2"):
        split_complete([2], 2, carried, outputs[:4], MAX)


def test_a_response_at_the_limit_over_its_pieces_is_finished():
    carried = [Carried(3, [_r([1], [2] * 8, pieces=[[0, 4], [1, 4]]), _r([1], [5], "stop")])]
    complete, carry = split_complete([], 2, carried, [[_r([], [3] * 4, "length", 2)]], MAX)
    assert not carry and complete[0].rollouts[0].finish_reason == "length"
    assert complete[0].rollouts[0].pieces == [[0, 4], [1, 4], [2, 4]] \
        and len(complete[0].rollouts[0].response_ids) == MAX


def test_partial_metrics_weigh_the_lag_by_tokens():
    groups = [Carried(0, [_r([1], [2] * 5, "stop", 1, [[1, 4], [3, 1]]), _r([1], [2], "stop", 3)])]
    metrics = partial_metrics(groups, [Carried(1, [])], version=3)
    assert metrics == {"rollout/partial_responses": 0.5, "rollout/token_version_lag_mean": (4 * 2) / 6,
                       "rollout/carried_groups": 1.0}


PROMPTS = [[5, 17, 42], [7], [100, 101, 102, 103, 104, 105, 106], [3, 3]]
STOPS = tuple(range(0, VOCAB, 7))  # about 1 token in 7 ends a response


@pytest.fixture
def one_thread():
    """Tiny matmuls gain nothing from threads (tests/unit/test_rollout_hf_engine.py); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_greedy_pieces_continue_exactly_as_one_call_generates(one_thread):
    """The engine's continuation is the plain prompt path: prompt + prefix as one prompt. Greedy,
    4 tokens a batch, new prompts joining while others continue: every response equals the one
    a single call of 12 tokens gives."""
    engine = HFEngine(tiny_qwen2(0), eos_token_ids=(), max_batch_size=64)
    whole = engine.generate(PROMPTS, 2, SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=STOPS))
    piece = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=STOPS)
    carry, done = [], {}
    for batch in range(6):
        fresh = [batch] if batch < len(PROMPTS) else []
        outputs = engine.generate(engine_inputs(PROMPTS, fresh, 2, carry, MAX), 1, piece)
        complete, carry = split_complete(fresh, 2, carry, outputs, MAX)
        done |= {g.prompt_index: g.rollouts for g in complete}
    assert not carry and sorted(done) == [0, 1, 2, 3]
    assert any(len(r.pieces) > 1 for group in done.values() for r in group), "nothing was continued"
    for i, group in enumerate(whole):
        for want, got in zip(group, done[i]):
            assert (got.response_ids, got.finish_reason) == (want.response_ids, want.finish_reason)
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def test_settings_and_refusals():
    assert RolloutConfig(max_response_length=16).piece_tokens == 16
    assert RolloutConfig(max_response_length=16, partial=True).piece_tokens == 4  # a quarter by default
    trainer = TrainConfig(old_log_probs="trainer")
    with pytest.raises(ConfigError, match="rollout.partial_tokens=5000 does not divide "
                       "rollout.max_response_length=20480"):
        DAPOConfig(rollout=RolloutConfig(partial=True, partial_tokens=5000), train=trainer)
    with pytest.raises(ConfigError, match="max_response_length / 4 does not divide rollout.max_response_length=20482"):
        DAPOConfig(rollout=RolloutConfig(max_response_length=20482, partial=True), train=trainer)
    with pytest.raises(ConfigError, match="set rollout.partial=true"):
        DAPOConfig(rollout=RolloutConfig(partial_tokens=8))
    with pytest.raises(ConfigError, match="rollout.partial_unfinished=abort needs rollout.partial=true"):
        DAPOConfig(rollout=RolloutConfig(partial_unfinished="abort"))
    with pytest.raises(ConfigError, match="rollout.partial=true with train.old_log_probs=rollout"):
        DAPOConfig(rollout=RolloutConfig(partial=True), train=TrainConfig(old_log_probs="rollout"))
    cfg = DAPOConfig(rollout=RolloutConfig(engine="hf", partial=True), train=TrainConfig(old_log_probs="trainer"))
    corr = derive(cfg, on_gpu=False)[0].algorithm.rollout_correction
    assert (corr.rollout_is, corr.rollout_is_threshold) == ("token", ASYNC_TIS_CAP)
    assert cfg.surplus == "carry" and DAPOConfig().surplus == "drop"  # the groups past the batch: the short ones
    check_rollout(cfg, 1)  # one colocated replica holds the carry
    with pytest.raises(ConfigError, match="rollout.partial=true with 2 colocated rollout replicas"):
        check_rollout(cfg, 2)


def test_an_engine_that_cannot_continue_a_prefix_is_refused(monkeypatch):
    monkeypatch.setattr(HFEngine, "continues_prefixes", False)
    cfg = DAPOConfig(rollout=RolloutConfig(engine="hf", partial=True), train=TrainConfig(old_log_probs="trainer"))
    with pytest.raises(ConfigError, match="rollout.engine=hf: this engine cannot continue a response"):
        check_rollout(cfg, 1)
    check_rollout(dataclasses.replace(cfg, rollout=RolloutConfig(engine="hf")), 1)  # only partial needs it


def test_the_carry_and_a_batchs_carried_groups_round_trip_through_the_trainer_state():
    group = Carried(4, [_r([1], [2, 3, 4, 5], version=2), _r([1], [6, 7], "stop", 1, [[0, 1], [1, 1]])])
    ahead = GenRequest(3, [1, 2], seed=9, rollouts=[[_r([1], [2])]], carried=[group])
    state = TrainerState(step=3, sampler={}, carried=(group.to_json(),), ahead=(ahead.to_json(),))
    back = TrainerState.from_json(state.to_json(), "x")
    assert Carried.from_json(back.carried[0]) == group
    assert GenRequest.from_json(back.ahead[0]) == ahead
    assert TrainerState.from_json({k: v for k, v in state.to_json().items() if k != "carried"}, "x").carried == ()


def test_aborting_the_carry_drops_its_groups_and_counts_their_tokens():
    """rollout.partial_unfinished=abort: at a full step the groups still growing go, and the
    tokens generated for them (finished responses of those groups included) are the waste metric."""
    from megatron_dapo.gen_batches import GenerationBatches

    gen = GenerationBatches.__new__(GenerationBatches)  # the carry alone: no run is needed
    gen.carry = [Carried(4, [_r([1], [2, 3, 4, 5]), _r([1], [6, 7], "stop")]), Carried(9, [_r([1, 2], [8])])]
    assert gen.abort_carry() == 7 and gen.carry == [] and gen.carry_json() == []
    assert gen.abort_carry() == 0
