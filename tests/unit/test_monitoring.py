"""The paper's monitoring set: all-wrong / all-correct group fractions (DynamicSampler) and the
mean generation probability of sampled tokens (groups.rollout_metrics), against hand-computed values."""

import math

import pytest
import torch

from megatron_dapo.algo import DynamicSampler
from megatron_dapo.groups import Group, rollout_metrics
from megatron_dapo.rollout.engine import Rollout


def _acc(rows):
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("enabled", [True, False])
def test_all_wrong_all_correct_fractions_cover_every_generated_group(enabled):
    s = DynamicSampler(prompts_per_step=2, group_size=3, max_num_gen_batches=0, enabled=enabled)
    s.start_step()
    s.add(["a", "b", "c", "d"], _acc([[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]))
    if enabled:  # only d kept: a second batch
        s.add(["e", "f"], _acc([[1, 1, 1], [0, 1, 1]]))
        generated = 6  # all wrong: a, c; all correct: b, e
        want_wrong, want_correct = 2 / 6, 2 / 6
    else:  # every group kept: one batch of 4, all wrong: a, c; all correct: b
        generated = 4
        want_wrong, want_correct = 2 / 4, 1 / 4
    _, m = s.pop()
    assert m["dynamic_sampling/num_groups_generated"] == generated
    assert m["dynamic_sampling/frac_all_wrong"] == pytest.approx(want_wrong)
    assert m["dynamic_sampling/frac_all_correct"] == pytest.approx(want_correct)
    s.start_step()  # per step: the next step starts from zero
    s.add(["g", "h"], _acc([[1, 0, 0], [0, 1, 0]]))
    _, m = s.pop()
    assert (m["dynamic_sampling/frac_all_wrong"], m["dynamic_sampling/frac_all_correct"]) == (0.0, 0.0)


def _group(logprobs_per_rollout):
    rollouts = [Rollout(prompt_ids=[1], response_ids=list(range(len(lp))), logprobs=lp, finish_reason="stop")
                for lp in logprobs_per_rollout]
    n = len(rollouts)
    return Group(prompt_index=0, rollouts=rollouts, acc=[True] * n, scores=[1.0] * n, rewards=[1.0] * n)


def test_token_prob_mean_is_the_mean_over_response_tokens():
    # 5 tokens in all, not a mean of per-response means: (0.5 + 0.25 + 1 + 0.1 + 0.9) / 5
    lps = [[math.log(0.5), math.log(0.25)], [0.0], [math.log(0.1), math.log(0.9)]]
    m = rollout_metrics([_group(lps[:2]), _group(lps[2:])])
    assert m["rollout/token_prob_mean"] == pytest.approx(2.75 / 5)


def test_token_prob_mean_absent_without_engine_logprobs():
    assert "rollout/token_prob_mean" not in rollout_metrics([_group([[], []])])
