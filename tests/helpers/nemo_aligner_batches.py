"""NeMo-Aligner-shaped rollout batches and hand references for the adapter's tests
(tests/unit/test_nemo_aligner_*.py)."""

import math

import torch

from megatron_dapo.integrations import nemo_aligner as na

EOS = 0


def rollout_batch(prompt_lens, gen_lens, rewards, *, group_size, width=None, seed=0, is_end=None, prompt_of=None):
    """A batch in NeMo-Aligner's layout. Row i's prompt is number ``prompt_of[i]`` (default
    i // group_size: groups in consecutive rows; ReinforceTrainer's own order interleaves them)."""
    prompt_of = prompt_of or [i // group_size for i in range(len(prompt_lens))]
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    prompt_lengths, gen = torch.tensor(prompt_lens), torch.tensor(gen_lens)
    response_lengths = prompt_lengths + gen
    s = width or int(response_lengths.max()) + 2
    tokens = torch.full((b, s), EOS)
    for i in range(b):
        prompt = torch.randint(1, 50, (int(prompt_lengths[i]),), generator=torch.Generator().manual_seed(
            1000 + seed * 100 + prompt_of[i]))
        tokens[i, : prompt_lengths[i]] = prompt
        tokens[i, prompt_lengths[i]: response_lengths[i]] = torch.randint(1, 50, (int(gen[i]),), generator=g)
    return {"response_tokens": tokens, "prompt_lengths": prompt_lengths, "response_lengths": response_lengths,
            "is_end": torch.ones(b, dtype=torch.bool) if is_end is None else torch.tensor(is_end),
            "logprobs": -torch.rand(b, s - 1, generator=g, dtype=torch.float64) * 3,
            "rewards": torch.tensor(rewards, dtype=torch.float64)}


def settings(**over):
    raw = {"initial_policy_kl_penalty": 0, "num_rollouts_per_prompt": 4, "prompts_per_step": 2,
           "reward": {"overlong_buffer": {"len": 4}}, **over}
    return na.trainer_settings(raw, max_response_length=8, model_gbs=4)


def groups_and_data(batch, s):
    groups = na.group_rows(batch["response_tokens"], batch["prompt_lengths"], s.group_size)
    return groups, na.dapo_rollout_data(batch, groups, s)[0]


def hand_loss(curr, data, low=0.2, high=0.28, c=3.0):
    """DAPO Eq. 8 with the dual clip, token by token: sum over valid tokens / their number."""
    total, n = 0.0, 0
    for i in range(curr.shape[0]):
        for j in range(curr.shape[1]):
            if data["mask"][i, j] == 0:
                continue
            a, r = float(data["advantages"][i, j]), math.exp(float(curr[i, j] - data["prev_logprobs"][i, j]))
            loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            total, n = total + (min(loss, -a * c) if a < 0 else loss), n + 1
    return total / n


MIXED = dict(prompt_lens=[3, 3, 3, 3, 2, 2, 2, 2], gen_lens=[2, 7, 4, 1, 5, 3, 8, 2],
             rewards=[1, -1, -1, 1, -1, -1, 1, -1], group_size=4)
