"""Pure-torch DAPO algorithm pieces: no megatron, no vllm, no torch.distributed."""

from megatron_dapo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_grpo_advantages,
    compute_mean_baseline_advantages,
    get_advantage_fn,
)
from megatron_dapo.algo.aggregation import AGG_MODES, aggregate
from megatron_dapo.algo.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted
from megatron_dapo.algo.losses import (
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    compute_cispo_loss,
    compute_gspo_loss,
    compute_policy_loss,
    get_policy_loss_fn,
)
from megatron_dapo.algo.reward_shaping import overlong_filter_mask, overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "MAX_LOG_RATIO", "POLICY_LOSSES", "DynamicSampler",
    "DynamicSamplingExhausted", "aggregate", "compute_cispo_loss", "compute_grpo_advantages", "compute_gspo_loss",
    "compute_mean_baseline_advantages", "compute_policy_loss", "get_advantage_fn", "get_policy_loss_fn",
    "overlong_filter_mask", "overlong_penalty",
]
