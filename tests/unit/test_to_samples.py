"""groups.to_samples: kept groups -> trainer samples, checked sample by sample against the groups
themselves (built as one tensor per kind and split, so every offset must land right)."""

import pytest
import torch

from megatron_dapo.config import DAPOConfig, RewardConfig
from megatron_dapo.groups import Group, to_samples
from megatron_dapo.rollout.engine import Rollout


def _groups(seed: int, num: int = 3, n: int = 4) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(num):
        prompt = torch.randint(1, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        rollouts, rewards = [], []
        for k in range(n):
            r = int(torch.randint(0, 7, (1,), generator=g))  # 0: an empty response
            lp = (-torch.rand(r, generator=g)).tolist() if (p + k) % 3 else []  # some without log-probs
            rollouts.append(Rollout(prompt_ids=prompt, response_ids=torch.randint(1, 50, (r,), generator=g).tolist(),
                                    logprobs=lp, finish_reason="length" if k == 1 else "stop"))
            rewards.append(float(torch.randn((), generator=g)))
        out.append(Group(prompt_index=p, rollouts=rollouts, acc=[x > 0 for x in rewards],
                         scores=[1.0 if x > 0 else -1.0 for x in rewards], rewards=rewards))
    return out


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_each_sample_is_its_rollout(overlong_filter):
    cfg = DAPOConfig(reward=RewardConfig(overlong_filter=overlong_filter))
    groups = _groups(0)
    samples = to_samples(groups, cfg.algorithm, cfg.reward)
    assert len(samples) == sum(len(g.rollouts) for g in groups)
    rollouts = [(g, r) for g in groups for r in g.rollouts]
    for s, (g, r) in zip(samples, rollouts):
        rewards = torch.tensor(g.rewards)
        adv = (rewards[g.rollouts.index(r)] - rewards.mean()) / (rewards.std() + cfg.algorithm.adv_eps)
        assert s.advantages == pytest.approx(float(adv), rel=1e-5)
        assert s.prompt_ids.tolist() == r.prompt_ids and s.response_ids.tolist() == r.response_ids
        keep = 0.0 if overlong_filter and r.finish_reason == "length" else 1.0
        assert s.loss_mask.tolist() == [keep] * len(r.response_ids)
        if r.logprobs:
            assert torch.equal(s.rollout_log_probs, torch.tensor(r.logprobs, dtype=torch.float32))
        else:
            assert s.rollout_log_probs is None
        assert s.prompt_ids.dtype == s.response_ids.dtype == torch.long and s.old_log_probs is None
