"""Rollouts from vLLM (GPU); the only module that imports vllm, and only when an engine is built.

Written against vLLM's offline ``LLM`` API (container/Dockerfile pins 0.33.0). The calls used
are listed at the end of this docstring; they were read in vLLM's newest available sources and in
the docs.vllm.ai pages up to v0.32, not in the 0.33.0 tag itself, and nothing here has run yet
(CPU-only machine): tests/gpu/test_vllm_engine.py is the check.

Placement.
- ``mode="colocated"`` (training): every torchrun rank builds its own ``LLM`` with
  ``distributed_executor_backend="external_launcher"``: one in-process vLLM worker per rank,
  sharing the rank's GPU with Megatron. vLLM carves its TP groups out of the torch.distributed
  world; the ranks beyond one TP group form independent replicas (world = rollout_TP x DP), so
  ranks of one TP group must pass identical prompts and params, and different replicas should
  get different prompts (and different seeds: the seed is the caller's, per call).
- ``mode="standalone"``: an ordinary ``LLM`` owning its GPUs (evaluation, or a separate
  generation process). Weight updates are pickled across vLLM's worker RPC on the CPU: fine for
  tests and small models, slow for 32B (a NCCL transport is future work).

Log-probs. Our contract (engine.py) is log_softmax(logits / T) of the sampled token, without
top-p/top-k renormalisation. vLLM's engine-level ``logprobs_mode`` offers (vllm/v1/sample/
sampler.py, topk_topp_sampler.py): "raw_logprobs" = log_softmax of the logits before any
processing, temperature included (i.e. at T = 1); "processed_logprobs" = log_softmax after temperature AND the
top-k/top-p masking, i.e. renormalised over the kept tokens. So:
- T = 1 (DAPO training and evaluation): "raw_logprobs" is exact, with or without top-p/top-k.
- T != 1, no top-p/top-k: "processed_logprobs" is exact.
- T != 1 with top-p/top-k: no mode reports it; generate() refuses rather than return wrong
  numbers. Use SamplingParams(logprobs=False) and the trainer's recomputed log-probs.
The mode is fixed when the engine is built; ``logprobs_mode_for`` picks it from the params.

Weight sync. ``LLM.apply_model(fn)`` runs fn(model) in every worker; the model's own
``load_weights(iterable of (hf_name, tensor))`` fuses q/k/v and gate/up and slices its TP shard,
so full HF-named tensors go in unchanged (NeMo-RL's refit does the same, nvidia_stack.md 2.5).
Afterwards the prefix cache is reset (its KV blocks were computed by the old weights), unless
the KV cache is asleep: LLM.sleep resets it itself. Not handled: FP8 rollouts (need
quantise-on-load), pipeline-parallel rollouts.

Sleep. ``LLM(enable_sleep_mode=True)``; ``sleep(level=1)`` offloads weights to CPU and drops the
KV cache; ``wake_up(tags=["weights"])`` restores weights only (so a weight update does not pay
for the KV cache too), ``wake_up()`` restores the rest.

vLLM API used (sources, read in the vllm-project/vllm repository and docs.vllm.ai):
``LLM(model, tensor_parallel_size, distributed_executor_backend, gpu_memory_utilization,
enforce_eager, dtype, max_model_len, seed, enable_sleep_mode, logprobs_mode,
skip_tokenizer_init, generation_config, load_format, enable_prefix_caching)``;
``LLM.generate(prompts=[{"prompt_token_ids": [...]}], sampling_params=[...], use_tqdm=False)``
-> RequestOutput.outputs[j].{index, token_ids, logprobs, finish_reason} (token_ids include the
stop token: vllm/v1/core/sched/utils.py check_stop tests the already appended last token;
logprobs[t] is a dict token_id -> Logprob with ``.logprob``);
``SamplingParams(n, temperature, top_p, top_k, max_tokens, stop_token_ids, seed, logprobs,
detokenize)``; ``LLM.apply_model``, ``LLM.reset_prefix_cache``, ``LLM.sleep(level)``,
``LLM.wake_up(tags)``; examples/features/torchrun/torchrun_example_offline.py for
external_launcher.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, Literal

import torch

from megatron_dapo.rollout.engine import Rollout, SamplingParams, check_prompts, sequence_seed

VLLM_MISSING = ("the vllm rollout engine needs the vllm package (a CUDA machine; the version is pinned "
                "in container/Dockerfile): install it there, or use rollout.engine=hf on CPU")

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


def import_vllm() -> Any:
    """The vllm module, or an ImportError that says what to do instead."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


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


def to_vllm_params(vllm: Any, params: SamplingParams, *, n: int, seed: int | None,
                   stop_token_ids: Sequence[int]) -> Any:
    """vllm.SamplingParams for one request: explicit stops, token ids only, sampled-token logprobs."""
    return vllm.SamplingParams(
        n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_tokens, stop_token_ids=list(stop_token_ids), seed=seed,
        logprobs=0 if params.logprobs else None,  # 0 = only the sampled token's log-prob
        detokenize=False)


def to_rollout(prompt_ids: Sequence[int], completion: Any, want_logprobs: bool) -> Rollout:
    """One vLLM CompletionOutput -> Rollout."""
    token_ids = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a response with {completion.finish_reason!r} (aborted?)")
    logprobs: list[float] = []
    if want_logprobs:
        logprobs = [float(pos[tok].logprob) for tok, pos in zip(token_ids, completion.logprobs)]
    return Rollout(prompt_ids=list(prompt_ids), response_ids=token_ids, logprobs=logprobs,
                   finish_reason=completion.finish_reason)


def _load_weights(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (module level so it pickles in standalone mode)."""
    loaded = model.load_weights(weights)
    return len(loaded) if loaded is not None else len(weights)


class VLLMEngine:
    """RolloutEngine over vllm.LLM; see the module docstring for placement and log-probs.

    Args:
        model_path: HF checkpoint directory (config.json + safetensors); with
            load_format="dummy" only the config is read and weights come from update_weights.
        mode: "colocated" (torchrun ranks, external_launcher) or "standalone".
        logprobs_mode: fixed for the engine's life; pick it with logprobs_mode_for(params).
        max_model_len: prompt + response limit; vLLM also ends a response with "length" when it
            is reached, so keep it >= the longest prompt + max_tokens (None = the model's).
        eos_token_ids: ids that end a response; None reads the checkpoint's generation_config /
            config. Sent explicitly with every request, as the HF engine does (no tokenizer is
            loaded: the engine works on token ids).
        seed: vLLM's engine seed, used by requests without their own seed; identical on all
            ranks of a TP group keeps their sampling in lockstep.
        sleep_level: 1 offloads weights to CPU; 2 discards them (only if every wake_up is
            followed by a full update_weights before generating).
        llm_kwargs: passed to vllm.LLM as is (e.g. max_num_seqs), overriding the above.
    """

    def __init__(self, model_path: str, *, mode: Literal["colocated", "standalone"] = "colocated",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.7,
                 enforce_eager: bool = True, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, enable_sleep_mode: bool = True, sleep_level: int = 1,
                 logprobs_mode: LogprobsMode = "raw_logprobs",
                 eos_token_ids: Sequence[int] | None = None, load_format: str = "auto",
                 enable_prefix_caching: bool = True, **llm_kwargs: Any):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs, "
                             f"got {logprobs_mode!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self._vllm = import_vllm()
        self.mode = mode
        self.logprobs_mode = logprobs_mode
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.eos_token_ids = (tuple(eos_token_ids) if eos_token_ids is not None
                              else _checkpoint_eos_ids(model_path))
        self.dp_rank, self.dp_size = 0, 1
        if mode == "colocated":
            backend = "external_launcher"
            self.dp_rank, self.dp_size = _replica_coords(tensor_parallel_size)
            # The engine core must live in this process for apply_model to reach the model
            # directly (no pickling) and for scheduling to be deterministic across TP ranks.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        elif mode == "standalone":
            backend = None
            # apply_model ships a callable and tensors to the worker processes.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        else:
            raise ValueError(f"mode must be 'colocated' or 'standalone', got {mode!r}")
        kwargs = dict(
            model=model_path, tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=backend, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, dtype=dtype, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=enable_sleep_mode, logprobs_mode=logprobs_mode,
            # Token ids in and out: no tokenizer, and no sampling defaults from the checkpoint's
            # generation_config (Qwen's would silently change top_p / top_k).
            skip_tokenizer_init=True, generation_config="vllm", load_format=load_format,
            enable_prefix_caching=enable_prefix_caching)
        kwargs.update(llm_kwargs)
        self.llm = self._vllm.LLM(**kwargs)
        self._asleep: set[str] = set()

    @classmethod
    def from_rollout_config(cls, model_path: str, cfg: Any, **kwargs: Any) -> VLLMEngine:
        """Build from a config.RolloutConfig (TP, memory, eager, logprobs mode for its sampling)."""
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        mode = logprobs_mode_for(params)
        if mode is None and cfg.check_logprob_mismatch:
            raise ValueError(
                f"vLLM cannot report log_softmax(logits / T) with temperature={cfg.temperature} and "
                f"top_p={cfg.top_p} / top_k={cfg.top_k}: set rollout.check_logprob_mismatch=false and "
                "generate with SamplingParams(logprobs=False), or drop top-p/top-k, or use T = 1")
        kwargs.setdefault("tensor_parallel_size", cfg.tensor_parallel_size)
        kwargs.setdefault("gpu_memory_utilization", cfg.gpu_memory_utilization)
        kwargs.setdefault("enforce_eager", cfg.enforce_eager)
        return cls(model_path, logprobs_mode=mode or "raw_logprobs", **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Rollout]]:
        """n responses per prompt, result[i][k].

        With params.seed set, each response is its own vLLM request seeded with
        sequence_seed(seed, i, k) (the HF engine's streams; vLLM's kernels still make the tokens
        differ). With seed None, one request of n samples per prompt draws from the engine's RNG.
        """
        check_prompts(prompt_ids, n)
        if params.logprobs and self.logprobs_mode not in exact_logprobs_modes(params):
            raise ValueError(
                f"this engine reports {self.logprobs_mode}, which is not log_softmax(logits / T) for "
                f"temperature={params.temperature}, top_p={params.top_p}, top_k={params.top_k}; "
                f"exact modes here: {sorted(exact_logprobs_modes(params)) or 'none'}. Build the engine "
                "with logprobs_mode_for(params), or pass SamplingParams(logprobs=False)")
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        if params.seed is None:
            requests = [(i, to_vllm_params(self._vllm, params, n=n, seed=None, stop_token_ids=stops))
                        for i in range(len(prompt_ids))]
        else:
            requests = [(i, to_vllm_params(self._vllm, params, n=1, seed=sequence_seed(params.seed, i, k),
                                           stop_token_ids=stops))
                        for i in range(len(prompt_ids)) for k in range(n)]
        outputs = self.llm.generate(
            prompts=[{"prompt_token_ids": list(prompt_ids[i])} for i, _ in requests],
            sampling_params=[sp for _, sp in requests], use_tqdm=False)
        result: list[list[Rollout]] = [[] for _ in prompt_ids]
        for (i, _), out in zip(requests, outputs, strict=True):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                result[i].append(to_rollout(prompt_ids[i], completion, params.logprobs))
        return result

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors through each worker's model.load_weights.

        Wakes only the weights if the engine sleeps, so the KV cache stays released during a
        bucketed sync. Unknown names fail inside vLLM's loader (KeyError naming the parameter).
        """
        items = [(name, t.detach()) for name, t in weights]
        if self.mode == "standalone":
            items = [(name, t.cpu()) for name, t in items]  # pickled across vLLM's worker RPC
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        self.llm.apply_model(partial(_load_weights, weights=items))
        if "kv_cache" not in self._asleep:  # LLM.sleep already reset it along with the KV cache
            self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Release GPU memory for training (no-op when built with enable_sleep_mode=False)."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Restore whatever sleep() released and update_weights has not already restored."""
        if self._asleep:
            self.llm.wake_up(tags=None if len(self._asleep) == 2 else sorted(self._asleep))
            self._asleep = set()


def _replica_coords(tensor_parallel_size: int) -> tuple[int, int]:
    """(replica index, number of replicas) of this torchrun rank for external_launcher."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("mode='colocated' runs under torchrun: initialise torch.distributed first "
                           "(or use mode='standalone')")
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(f"world size {world} is not divisible by rollout tensor_parallel_size "
                         f"{tensor_parallel_size}")
    return dist.get_rank() // tensor_parallel_size, world // tensor_parallel_size


def _checkpoint_eos_ids(model_path: str) -> tuple[int, ...]:
    """EOS ids of a checkpoint directory: generation_config.json first, then config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
