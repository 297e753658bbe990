"""Rule-based rewards: scorers by name, and a process pool that bounds their time."""

from megatron_dapo.registry import Registry
from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.reward.pool import RewardPool

__all__ = ["REWARD_FNS", "RewardPool", "compute_score", "get_reward_fn"]

# A reward fn maps (response, ground_truth) to {"score": float, "acc": bool, "pred": str}.
REWARD_FNS: Registry = Registry("reward fn")
REWARD_FNS.register("dapo_math")(compute_score)


def get_reward_fn(name: str):
    """The reward fn registered as ``name`` (ValueError listing the valid names)."""
    return REWARD_FNS.get(name)
