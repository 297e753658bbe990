"""verl 0.9.1 as shipped (install.sh test puts its wheel and what it imports, --no-deps, in
.venv/upstream/verl-0.9.1): its policy losses, aggregation and DAPO scorer, called the way its actor
calls them, as the independent reference of algo/ and reward/paper_rule.py.

The directory goes to the END of sys.path: a package both have (packaging, yaml, ...) stays ours."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VERL_DIR = ROOT / ".venv/upstream/verl-0.9.1"


def verl():
    """(core_algos, math_dapo, ActorConfig) of verl 0.9.1; the test fails (never skips) when it is not
    installed, unless the whole suite runs outside install.sh test (then it skips, saying so)."""
    if not (VERL_DIR / "verl/trainer/ppo/core_algos.py").is_file():
        pytest.skip(f"verl 0.9.1 is not in {VERL_DIR}: run ./install.sh test")
    if str(VERL_DIR) not in sys.path:
        sys.path.append(str(VERL_DIR))
    from verl.trainer.ppo import core_algos
    from verl.utils.reward_score import math_dapo
    from verl.workers.config.actor import ActorConfig
    return core_algos, math_dapo, ActorConfig


def verl_loss(name: str, log_probs, old_log_probs, advantages, mask, *, clip_ratio_low, clip_ratio_high,
              clip_ratio_c=None, loss_agg_mode="token-mean", loss_scale_factor=None, rollout_is_weights=None):
    """verl's registered policy loss ``name`` ("vanilla" is our dapo) on one micro-batch that is the
    whole mini-batch (dp_size 1, its own denominators): the 0-d loss."""
    core_algos, _, actor_config = verl()
    cfg = actor_config(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       use_dynamic_bsz=False, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                       clip_ratio_c=clip_ratio_c if clip_ratio_c is not None else 1e9)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                 loss_scale_factor=loss_scale_factor)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_probs)
    loss, _ = core_algos.get_policy_loss_fn(name)(old_log_prob=old_log_probs, log_prob=log_probs, advantages=adv,
                                                  response_mask=mask, loss_agg_mode=loss_agg_mode, config=cfg,
                                                  rollout_is_weights=rollout_is_weights)
    return loss


def loss_and_grad(fn, log_probs: torch.Tensor, *args, **kwargs):
    """(loss, d loss / d log_probs) of ``fn(log_probs, *args, **kwargs)`` (its first value when a tuple)."""
    leaf = log_probs.detach().clone().requires_grad_(True)
    out = fn(leaf, *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), leaf.grad
