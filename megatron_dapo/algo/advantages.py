"""Group-relative advantages (outcome reward, one value per response).

Shapes: P = prompt groups, G = responses per prompt (group size).
"""

import torch

from megatron_dapo.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def compute_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO / DAPO Eq. 9: (r - mean_group) / (std_group + eps), unbiased std (as torch.std and verl).

    Args:
        rewards: [P, G] scalar reward of each response (DAPO: +-1 correctness plus the overlong
            penalty).
        eps: keeps the division finite; a group whose rewards are all equal gets exactly zeros.

    Returns:
        [P, G] advantages, same dtype as ``rewards``.
    """
    _check_groups(rewards)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=True, keepdim=True)
    adv = (rewards - mean) / (std + eps)
    # The mean of equal floats can be off by an ulp, and ulp / (ulp-sized std + eps) is not
    # small, so equal groups are zeroed explicitly rather than trusted to cancel.
    return torch.where(_is_constant(rewards), torch.zeros_like(adv), adv)


@ADVANTAGE_ESTIMATORS.register("grpo_mean_only")
def compute_mean_baseline_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783): r - mean_group, no division by the group std.

    ``eps`` is accepted for a uniform signature and unused.
    """
    _check_groups(rewards)
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    return torch.where(_is_constant(rewards), torch.zeros_like(adv), adv)


def _is_constant(rewards: torch.Tensor) -> torch.Tensor:
    """[P, G] -> [P, 1] bool, True where every reward of the group is equal."""
    return (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)


def _check_groups(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[-1] < 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size] with group_size >= 2, got shape {tuple(rewards.shape)}"
        )


def get_advantage_fn(name: str):
    """The advantage estimator registered as ``name`` (ValueError listing the valid names)."""
    return ADVANTAGE_ESTIMATORS.get(name)
