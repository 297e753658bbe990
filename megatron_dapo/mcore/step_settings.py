"""What the train step needs from the config, resolved once, and the device it computes on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_dapo.algo import get_policy_loss_fn
from megatron_dapo.batching import pad_multiple
from megatron_dapo.config import DAPOConfig


@dataclass(frozen=True)
class StepSettings:
    """What the step needs from the config, resolved once (see ``from_config``)."""

    policy_loss: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    loss_agg_mode: str
    temperature: float  # the rollout temperature: log-probs must be those of the sampler
    valid_vocab_size: int  # the real vocabulary; padded rows are excluded from the softmax
    max_tokens_per_micro_batch: int
    micro_batch_size: int
    pad_multiple: int
    chunk_tokens: int | None = None  # log-prob chunking; None = logprobs.py's memory default
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant (Dr. GRPO)
    pack_sequences: bool = False  # micro-batches of samples end to end (batching.py, packed)

    @classmethod
    def from_config(cls, cfg: DAPOConfig, vocab_size: int, *, packed: bool) -> "StepSettings":
        """``packed``: train.pack_sequences resolved against the model's layout (micro_batch_shapes.py)."""
        p, loss = cfg.parallel, cfg.loss_settings()
        return cls(policy_loss=loss.policy_loss, clip_ratio_low=loss.clip_ratio_low,
                   clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c,
                   loss_agg_mode=loss.loss_agg_mode, loss_scale_factor=loss.loss_scale_factor,
                   temperature=cfg.rollout.temperature,
                   valid_vocab_size=vocab_size,
                   max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                   micro_batch_size=cfg.train.micro_batch_size,
                   chunk_tokens=cfg.train.logprob_chunk_tokens or None,
                   pack_sequences=packed,
                   pad_multiple=pad_multiple(tensor_parallel=p.tensor_model_parallel_size,
                                             sequence_parallel=p.sequence_parallel,
                                             context_parallel=p.context_parallel_size,
                                             fp8=cfg.model.fp8 is not None))

    def policy_loss_fn(self):
        norm = {} if self.loss_scale_factor is None else {"loss_scale_factor": self.loss_scale_factor}
        return functools.partial(get_policy_loss_fn(self.policy_loss), clip_ratio_low=self.clip_ratio_low,
                                 clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c,
                                 loss_agg_mode=self.loss_agg_mode, **norm)


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
