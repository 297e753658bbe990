"""Rollout generation in the memory plan: the KV cache one vLLM replica gets, and two estimates of
how long a generation batch takes (docs/memory_plan.md, "Generation time").

FLOPs bound: 2 x parameters FLOPs per generated token (an MoE model's active ones: memory_plan.py
passes them) at a stated MFU (the prefill and attention's quadratic term left out). Bandwidth bound
(decode): each decode step of a replica reads the replica's weights once and the KV cache of every
sequence it is decoding; its GPUs work in parallel, each on its 1/TP of both, so a step takes
(weights + KV read) per GPU / (HBM bandwidth x efficiency) and yields one token per concurrent
sequence. Concurrency is what the KV cache holds at the mean sequence length, at most the responses
the replica has and vLLM's max_num_seqs; more responses than that run in waves. The slower of the two
estimates is the one that binds.

Pure functions of numbers and the HF config dict: no torch, no vllm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# vLLM's scheduler defaults for its offline LLM class on GPUs with >= 70 GiB (H100, H200):
# EngineArgs' usage-context defaults (vllm/engine/arg_utils.py, 0.32.0; the engine sets neither).
VLLM_MAX_NUM_SEQS = 1024
VLLM_MAX_NUM_BATCHED_TOKENS = 16384
# The fraction of peak HBM bandwidth a decode step achieves: an assumption, not a measurement
# (paged attention over short blocks and small GEMMs reach less than a streaming copy).
DECODE_BANDWIDTH_EFFICIENCY = 0.6


def kv_bytes_per_token(hf: dict, *, dtype_bytes: int = 2) -> int:
    """KV cache bytes of one token for the whole model: 2 (K and V) x layers x KV heads x head_dim x
    dtype bytes (vLLM's kv_cache_dtype "auto" is the model's dtype: bf16, 2 B)."""
    from megatron_dapo.convert.mapping import hf_sizes

    sizes = hf_sizes(hf)  # the one reader of head_dim and the KV heads
    return 2 * sizes["num_layers"] * sizes["num_query_groups"] * sizes["kv_channels"] * dtype_bytes


def kv_bytes_per_token_per_gpu(hf: dict, tensor_parallel: int, *, dtype_bytes: int = 2) -> float:
    """The share of kv_bytes_per_token one GPU of a replica holds: its KV heads. Below one head per
    GPU vLLM replicates a head on each GPU, so the share never drops below one head."""
    from megatron_dapo.convert.mapping import hf_sizes

    kv_heads = hf_sizes(hf)["num_query_groups"]
    return kv_bytes_per_token(hf, dtype_bytes=dtype_bytes) * max(1.0, kv_heads / tensor_parallel) / kv_heads


def vllm_activation_bytes(hf: dict, tensor_parallel: int, *, dtype_bytes: int = 2) -> float:
    """vLLM's start-up profile peak per GPU (bytes), which it subtracts from its share before the KV
    cache: the larger of a forward at max_num_batched_tokens (the MLP's gate/up output and its
    activation, [T, 3 x ffn / TP]; ffn: the width a token goes through, an MoE model's top-k experts') and
    the sampler over max_num_seqs full-vocabulary rows (fp32 logits and their log-softmax). Ours, from the
    shapes; vLLM measures it at start-up."""
    from megatron_dapo.plan_params import active_ffn

    forward = VLLM_MAX_NUM_BATCHED_TOKENS * 3 * active_ffn(hf) / tensor_parallel * dtype_bytes
    sampler = VLLM_MAX_NUM_SEQS * hf["vocab_size"] * 4 * 2
    return float(max(forward, sampler))


@dataclass(frozen=True)
class Replica:
    """One replica's generation batch, the decode model's inputs.

    responses: responses the replica generates in the batch.
    prompt_tokens, response_tokens: their mean lengths (tokens).
    kv_tokens: tokens its KV cache holds (per replica; every GPU holds its heads of each token).
    weight_bytes_per_gpu: the engine's weight shard on one GPU (bytes).
    kv_bytes_per_token_per_gpu: one token's KV on one GPU (bytes).
    hbm_bytes_per_s: one GPU's peak HBM bandwidth; efficiency: the fraction a decode step achieves.
    """

    responses: int
    prompt_tokens: float
    response_tokens: float
    kv_tokens: float
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    hbm_bytes_per_s: float
    efficiency: float = DECODE_BANDWIDTH_EFFICIENCY
    max_num_seqs: int = VLLM_MAX_NUM_SEQS


@dataclass(frozen=True)
class DecodeEstimate:
    """concurrency: sequences decoded together; limited_by: which limit set it ("KV cache",
    "responses", "max_num_seqs"); step_s: one decode step at that concurrency (s); tokens_per_s: per
    replica; waves: rounds of concurrency the responses need; seconds: the batch (inf without KV)."""

    concurrency: int
    limited_by: str
    step_s: float
    tokens_per_s: float
    waves: int
    seconds: float


def decode_step_seconds(r: Replica, concurrent: int) -> float:
    """One decode step with ``concurrent`` sequences: the weight shard plus their KV, read once. A
    sequence reads its prompt and, on average over its decoding, half its response."""
    kv_read = concurrent * (r.prompt_tokens + r.response_tokens / 2) * r.kv_bytes_per_token_per_gpu
    return (r.weight_bytes_per_gpu + kv_read) / (r.hbm_bytes_per_s * r.efficiency)


def decode_estimate(r: Replica) -> DecodeEstimate:
    """The bandwidth bound of one generation batch on one replica (all replicas run in parallel)."""
    by_kv = r.kv_tokens / (r.prompt_tokens + r.response_tokens)
    limits = {"KV cache": by_kv, "responses": r.responses, "max_num_seqs": r.max_num_seqs}
    limited_by = min(limits, key=limits.get)
    concurrency = int(limits[limited_by])
    if concurrency < 1:  # not one sequence fits: vLLM would refuse to start (check_fits says so)
        return DecodeEstimate(0, limited_by, math.inf, 0.0, 0, math.inf)
    step = decode_step_seconds(r, concurrency)
    full, rest = divmod(r.responses, concurrency)
    seconds = full * r.response_tokens * step
    if rest:  # the last wave decodes fewer sequences, each step reading less KV
        seconds += r.response_tokens * decode_step_seconds(r, rest)
    return DecodeEstimate(concurrency, limited_by, step, concurrency / step, full + (rest > 0), seconds)


@dataclass(frozen=True)
class GenerationTime:
    """Both estimates of one generation batch (seconds); the larger binds."""

    flops_s: float
    decode: DecodeEstimate | None  # None: not a vLLM engine (no KV cache sizing to model)

    @property
    def seconds(self) -> float:
        return max(self.flops_s, self.decode.seconds if self.decode else 0.0)

    @property
    def binds(self) -> str:
        return "HBM bandwidth (decode)" if self.decode and self.decode.seconds > self.flops_s else "FLOPs"


def flops_seconds(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """``flops`` spread over ``gpus`` GPUs at ``mfu`` of ``peak_flops`` each (FLOP/s)."""
    return flops / (gpus * peak_flops * mfu)
