"""Rollout engines (HF transformers on CPU, vLLM on GPU) behind one protocol, and weight sync.

Importing this package never imports vllm: only building a VLLMEngine does.
"""

from megatron_dapo.rollout.engine import (
    ENGINES,
    Rollout,
    RolloutEngine,
    SamplingParams,
    eval_sampling_params,
    get_engine_cls,
    rollout_sampling_params,
    sequence_seed,
)
from megatron_dapo.rollout.weight_sync import bucketed, logprob_mismatch, score_logprobs, sync_weights

__all__ = [
    "ENGINES",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "bucketed",
    "eval_sampling_params",
    "get_engine_cls",
    "logprob_mismatch",
    "rollout_sampling_params",
    "score_logprobs",
    "sequence_seed",
    "sync_weights",
]
