"""Moving trainer weights into a rollout engine, and checking that the two then agree.

``sync_weights`` streams (hf_name, tensor) pairs, as produced by the converter's streaming export
of the live sharded model, into ``engine.update_weights`` in buckets of bounded size, so peak
extra memory is one bucket rather than a second copy of the model (the NeMo-RL refit pattern,
docs/reference/nvidia_stack.md 2.5, without its CUDA-IPC transport).

``logprob_mismatch`` is the DESIGN's ``rollout/logprob_mismatch`` metric (NeMo-RL calls it
``token_mult_prob_error``; its guide expects it within 1-2% of 1.0). ``score_logprobs`` is a
teacher-forced HF forward pass: the reference an engine's reported log-probs are checked against.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from megatron_dapo.convert.packing import iter_packed
from megatron_dapo.rollout.engine import RolloutEngine

Bucket = list[tuple[str, torch.Tensor]]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group consecutive (name, tensor) pairs into buckets of at most ``bucket_bytes`` bytes.

    Order is preserved and every pair lands in exactly one bucket. A tensor larger than the
    limit gets a bucket of its own (it cannot be split: engines load whole tensors). The input
    is consumed lazily, so at most one bucket is held at a time.
    """
    return iter_packed(weights, lambda pair: tensor_bytes(pair[1]), bucket_bytes)


def sync_weights(engine: RolloutEngine, weights: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> dict[str, int]:
    """Stream ``weights`` into ``engine.update_weights`` one bucket at a time.

    Then ``engine.finish_weight_update()`` (when the engine has it: minimal engines may apply
    every bucket at once). Returns counts for logging: num_buckets, num_tensors, num_bytes.
    """
    stats = new_counts()
    for bucket in bucketed(weights, bucket_bytes):
        engine.update_weights(bucket)
        count_bucket(stats, bucket)
    finish_update(engine)
    return stats


def new_counts() -> dict[str, int]:
    """A weight stream's counts for logging (sync_weights and the separate placement's stream)."""
    return {"num_buckets": 0, "num_tensors": 0, "num_bytes": 0}


def count_bucket(counts: dict[str, int], bucket: Bucket) -> None:
    counts["num_buckets"] += 1
    counts["num_tensors"] += len(bucket)
    counts["num_bytes"] += sum(tensor_bytes(t) for _, t in bucket)


def finish_update(engine) -> None:
    """``engine.finish_weight_update()`` when the engine has it (minimal engines apply every bucket
    at once)."""
    finish = getattr(engine, "finish_weight_update", None)
    if finish is not None:
        finish()


# logprob_mismatch's figures (also measured inside an update: mcore/train_step.py).
MISMATCH_KEYS = ("rollout/logprob_mismatch", "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max")


def logprob_mismatch(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's.

    Args:
        engine_logprobs: [B, T] log-probs reported by the rollout engine.
        trainer_logprobs: [B, T] log-probs of the same tokens from the trainer's forward.
        mask: [B, T] 1 for response tokens, 0 for padding (bool or 0/1).

    Returns:
        detached fp32 scalars: ``rollout/logprob_mismatch`` = mean over tokens of
        exp(|diff|) (1.0 = identical), ``rollout/logprob_abs_diff_mean`` and
        ``rollout/logprob_abs_diff_max``. With no valid token: 1.0, 0.0, 0.0.
    """
    if not engine_logprobs.shape == trainer_logprobs.shape == mask.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine_logprobs.shape)}, trainer "
                         f"{tuple(trainer_logprobs.shape)}, mask {tuple(mask.shape)}")
    valid = mask.bool()
    diff = (engine_logprobs.detach().float() - trainer_logprobs.detach().float()).abs()
    diff = torch.where(valid, diff, torch.zeros_like(diff))  # padding may hold inf or nan
    count = valid.sum().clamp(min=1).float()
    # exp(|d|) - 1 is 0 on padding, so the masked sum needs no second where; adding 1 back
    # after the mean makes the empty case 1.0 (perfect agreement) rather than 0.
    return {
        "rollout/logprob_mismatch": torch.expm1(diff).sum() / count + 1.0,
        "rollout/logprob_abs_diff_mean": diff.sum() / count,
        "rollout/logprob_abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
    }


@torch.no_grad()
def score_logprobs(hf_model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                   response_ids: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
    """Teacher-forced log_softmax(logits / T) of each response token given its prompt.

    One right-padded batch: real tokens keep positions 0..len-1 and causal attention never looks
    right, so the padding cannot change them. Logits are cast to fp32 before the division.

    Args:
        hf_model: a transformers causal LM.
        prompt_ids, response_ids: B token-id lists each; prompts must be non-empty.
        temperature: the sampling temperature (0 is read as 1, matching engine.py's greedy rule).

    Returns:
        B lists, one log-prob per response token.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if not prompt_ids:
        return []
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    temp = temperature if temperature > 0 else 1.0
    device = next(hf_model.parameters()).device
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    max_len = max(len(s) for s in seqs)
    ids_BL = torch.zeros((len(seqs), max_len), dtype=torch.long)
    mask_BL = torch.zeros_like(ids_BL)
    for b, s in enumerate(seqs):
        ids_BL[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask_BL[b, :len(s)] = 1
    logits_BLV = hf_model(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device),
                          use_cache=False).logits
    logp_BLV = torch.log_softmax(logits_BLV.float() / temp, dim=-1).cpu()
    out: list[list[float]] = []
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        # The logits at position t predict token t + 1.
        rows = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        out.append(logp_BLV[b, rows, torch.tensor(list(r), dtype=torch.long)].tolist())
    return out
