"""What the vLLM engine works out without vllm: which logprobs mode is exact for our sampling params,
the trainer's dtype in vLLM's name, a run's rollout config as constructor arguments, our
SamplingParams as vLLM's and vLLM's outputs as Rollouts, and what is read from the checkpoint's
config (head_dim, EOS ids). Re-exported by vllm_engine.

Kept apart from vllm_engine.py, which drives vllm.LLM, because none of this needs vllm or a built
engine: each rule is a plain function of our types (``to_vllm_params`` is handed the vllm module).

Log-probs. Our contract (engine.py) is log_softmax(logits / T) of the sampled token, without
top-p/top-k renormalisation. vLLM's engine-level ``logprobs_mode`` offers (vllm/v1/sample/
sampler.py, topk_topp_sampler.py): "raw_logprobs" = log_softmax of the logits before any
processing, temperature included (i.e. at T = 1); "processed_logprobs" = log_softmax after
temperature AND the top-k/top-p masking, i.e. renormalised over the kept tokens. So:
- T = 1 (DAPO training and evaluation): "raw_logprobs" is exact, with or without top-p/top-k.
- T != 1, no top-p/top-k: "processed_logprobs" is exact.
- T != 1 with top-p/top-k: no mode reports it; generate() refuses rather than return wrong
  numbers. Use SamplingParams(logprobs=False) and the trainer's recomputed log-probs.
The mode is fixed when the engine is built; ``logprobs_mode_for`` picks it from the params.
Measured on CPU in fp32 (tiny Qwen2s): at most 3.6e-5 from a teacher-forced HF forward (logits
of ~N(0, 0.3) weights), ~1e-6 from the Megatron actor's log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.engine import Rollout, SamplingParams
from megatron_dapo.rollout.routes import Routes

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


def exact_logprobs_modes(params: SamplingParams) -> set[str]:
    """The vLLM logprobs modes whose numbers equal our contract for these params."""
    modes = set()
    if params.temperature in (0.0, 1.0):
        modes.add("raw_logprobs")  # at T = 1 (and greedy, reported at T = 1) raw is the contract
    if params.temperature > 0 and not params.truncated:
        modes.add("processed_logprobs")  # only temperature applied, nothing renormalised
    return modes


def logprobs_mode_for(params: SamplingParams) -> LogprobsMode | None:
    """The mode to build the engine with for these (training) params; None when none is exact."""
    modes = exact_logprobs_modes(params)
    for mode in ("raw_logprobs", "processed_logprobs"):
        if mode in modes:
            return mode
    return None


def vllm_dtype(model_dtype: str, on_gpu: bool) -> str:
    """config.ModelConfig.dtype -> vLLM's name for the trainer's dtype (precision.resolve_dtype)."""
    from megatron_dapo.precision import resolve_dtype

    return {"bf16": "bfloat16", "fp32": "float32"}[resolve_dtype(model_dtype, on_gpu)]


def to_vllm_params(vllm: Any, params: SamplingParams, *, seed: int,
                   stop_token_ids: Sequence[int]) -> Any:
    """vllm.SamplingParams for one response: explicit stops, token ids only, sampled-token logprobs."""
    return vllm.SamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_tokens, stop_token_ids=list(stop_token_ids), seed=seed,
        logprobs=0 if params.logprobs else None,  # 0 = only the sampled token's log-prob
        detokenize=False)


def to_rollout(prompt_ids: Sequence[int], completion: Any, want_logprobs: bool, *, routes: bool = False) -> Rollout:
    """One vLLM CompletionOutput -> Rollout. ``routes``: the engine was built to return routed experts;
    vLLM's ``routed_experts`` [tokens executed, layers, k] (prompt + response - 1, as the HF engine's)
    becomes Rollout.routed_experts (rollout/routes.py)."""
    token_ids = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a response with {completion.finish_reason!r} (aborted?)")
    logprobs: list[float] = []
    if want_logprobs:
        logprobs = [float(pos[tok].logprob) for tok, pos in zip(token_ids, completion.logprobs)]
    routed = None
    if routes:
        fed = len(prompt_ids) + len(token_ids) - 1
        got = getattr(completion, "routed_experts", None)
        if got is None or len(got) != fed:
            raise RuntimeError(f"vLLM returned routed experts for {None if got is None else len(got)} tokens, "
                               f"not the {fed} it was fed (prompt + response - 1)")
        routed = Routes.of(got, fed)
    return Rollout(prompt_ids=list(prompt_ids), response_ids=token_ids, logprobs=logprobs,
                   finish_reason=completion.finish_reason, routed_experts=routed)


def rollout_kwargs(rollout: Any) -> dict[str, Any]:
    """Constructor arguments from a config.RolloutConfig (from_spec's rollout part)."""
    params = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
    mode = logprobs_mode_for(params)
    if mode is None and rollout.check_logprob_mismatch:
        raise ConfigError(
            f"vLLM cannot report log_softmax(logits / T) with temperature={rollout.temperature} and "
            f"top_p={rollout.top_p} / top_k={rollout.top_k}: set rollout.check_logprob_mismatch=false and "
            "generate with SamplingParams(logprobs=False), or drop top-p/top-k, or use T = 1")
    mb = rollout.kv_cache_memory_mb
    return dict(tensor_parallel_size=rollout.tensor_parallel_size,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                kv_cache_memory_bytes=mb << 20 if mb > 0 else None,
                enforce_eager=rollout.enforce_eager, logprobs_mode=mode or "raw_logprobs",
                sleep_level=rollout.sleep_level)


def checkpoint_hf_config(model_path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def checkpoint_eos_ids(model_path: str, hf_config: Any) -> tuple[int, ...]:
    """EOS ids of a checkpoint directory: generation_config.json first, then config.json."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
