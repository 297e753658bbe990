"""The rollout-engine contract: sampling parameters, one response's result, the engine protocol.

Both engines (HF transformers on CPU, vLLM on GPU) take token ids and return token ids: the
tokenizer and chat template live in data/, and rewards decode the ids themselves.

Log-prob contract (DESIGN "Numerics contract"). ``Rollout.logprobs[t]`` is the log-probability
of the sampled token t under the model's distribution at the sampling temperature T, i.e.
``log_softmax(logits / T)[token]`` in fp32, NOT renormalised over the top-p / top-k support.
That is the quantity the trainer computes (mcore/logprobs.py divides the logits by the same T),
so the two can be compared token by token (``rollout/logprob_mismatch``) and, when exactly
on-policy, used as the old log-probs of the PPO ratio. Truncation (top-p / top-k) changes which
tokens can be drawn, not the reported numbers. With temperature 0 (greedy, evaluation only) the
reported numbers are those of T = 1.

Randomness. Each response owns a random stream seeded by ``sequence_seed(seed, prompt_index,
sample_index)``, so a response does not depend on how requests are batched, chunked or ordered
(HF engine: same tokens and log-probs to fp32 round-off; vLLM: per-request seeds).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from megatron_dapo.registry import Registry
from megatron_dapo.rollout.routes import Routes

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; the engine-independent subset of vLLM's SamplingParams.

    Unlike vLLM there are no defaults to inherit from a model's generation_config: every value
    is explicit (the caller builds this from RolloutConfig / EvalConfig).
    """

    temperature: float = 1.0
    """Logits are divided by this before softmax; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose mass reaches top_p; 1 = off."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = off."""
    max_tokens: int = 16
    """Response length cap; hitting it gives finish_reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens, on top of the engine's EOS ids; the stop token ends the response."""
    seed: int | None = None
    """Base seed of the per-response streams; None draws one from torch's global generator."""
    logprobs: bool = True
    """Report per-token log-probs; evaluation can switch them off (vLLM then skips the check
    that its logprobs mode can report them exactly)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        # Accept any iterable (YAML gives lists) but store a tuple so the dataclass stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def truncated(self) -> bool:
        """True when top-p or top-k restricts the support of the sampling distribution."""
        return self.top_p < 1.0 or self.top_k != -1


def rollout_sampling_params(cfg: Any, *, seed: int | None = None,
                            stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """Training-rollout params from a config.RolloutConfig (log-probs on)."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_response_length, stop_token_ids=tuple(stop_token_ids),
                          seed=seed, logprobs=True)


def eval_sampling_params(cfg: Any, *, max_tokens: int, seed: int | None = None,
                         stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """Evaluation params from a config.EvalConfig (no top-k; log-probs off: nothing uses them);
    ``max_tokens``: DAPOConfig.eval_max_response_length."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=-1,
                          max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids),
                          seed=seed, logprobs=False)


@dataclass(kw_only=True)
class Rollout:
    """One response to one prompt.

    ``response_ids`` includes the stop token when finish_reason is "stop" (the policy must learn
    to emit it), and ``logprobs`` has one entry per response token (empty when the request asked
    for none).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    weight_version: int = 0  # the trainer steps in the weights that generated it (placements stamp it)
    pieces: list[list[int]] = field(default_factory=list)
    """rollout.partial: [weight version, tokens] of each piece in order (the first is weight_version's);
    empty: the response is one piece, of weight_version (rollout/partial.py)."""
    routed_experts: Routes | None = None
    """An MoE model's routes, when the engine was asked for them (moe.router_replay=R3): the experts each
    layer sent each token to, [prompt + response - 1 tokens, layers x top-k] (the last token is never
    fed to the engine), one byte an expert (rollout/routes.py); None otherwise."""

    def __post_init__(self):
        if self.logprobs and len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        fed = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routed_experts is not None and self.routed_experts.tokens != fed:
            raise ValueError(f"routes for {self.routed_experts.tokens} tokens, not the {fed} fed to the engine "
                             "(prompt + response - 1)")

    def to_json(self) -> dict:
        """Plain JSON (a checkpoint's trainer state holds held, carried and asked-for-ahead rollouts)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["routed_experts"] = None if self.routed_experts is None else self.routed_experts.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Rollout":
        routes = data.get("routed_experts")
        if isinstance(routes, list):  # written before routes were packed: flat ints, [] for none
            fed = len(data["prompt_ids"]) + len(data["response_ids"]) - 1
            routes = Routes.of(routes, fed) if routes else None
        elif routes is not None:
            routes = Routes.from_json(routes)
        return cls(**{**data, "routed_experts": routes})


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What builds a run's rollout engine: the rollout section and the few settings it reads from
    elsewhere, not the run's whole config (what a separate placement's engine ranks receive)."""

    model_path: str  # model.hf_path: the checkpoint the engine loads (its weights come with the first sync)
    rollout: Any  # config.RolloutConfig
    dtype: str  # rollout.dtype, or model.dtype when that is auto
    seed: int
    max_model_len: int  # data.max_prompt_length + rollout.max_response_length
    num_threads: int = 0  # torch threads of an engine rank (num_threads; 0: torch's default)
    return_routed_experts: bool = False  # moe.router_replay=R3: every Rollout carries its routes

    @classmethod
    def of(cls, cfg: Any, *, model_path: str | None = None) -> EngineSpec:
        """The engine's part of a run's resolved config.DAPOConfig (``model_path``: another checkpoint
        than model.hf_path)."""
        return cls(model_path=str(cfg.model.hf_path if model_path is None else model_path), rollout=cfg.rollout,
                   dtype=engine_dtype(cfg.rollout.dtype, cfg.model.dtype), seed=cfg.seed, num_threads=cfg.num_threads,
                   max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                   return_routed_experts=cfg.moe.router_replay == "R3")


def engine_dtype(rollout_dtype: str, model_dtype: str) -> str:
    """The engine's dtype setting ("auto", "bf16", "fp32"): rollout.dtype, or the trainer's model.dtype."""
    return model_dtype if rollout_dtype == "auto" else rollout_dtype


class GenerationAborted(RuntimeError):
    """Raised by a ``generate`` that ``abort`` ended: it has no outputs."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What train.py and eval call; both engines implement it. Each class also has
    ``from_spec(spec)`` (the engine of a run, from its EngineSpec) and ``preflight(spec)`` (a staticmethod:
    cheap checks of the settings and installed packages before anything heavy; ValueError), a
    ``reads_hf_weights`` class attribute (whether a run's engine loads model.hf_path's safetensors,
    so that setup checks them first), a ``continues_prefixes`` one (whether a prompt may end inside
    a response, so that the response goes on from there: rollout.partial needs it), an
    ``fp32_logprobs_are_the_trainers`` one (whether, at fp32 from the trainer's weights, its
    log-probs of a response are the trainer's to round-off: train.old_log_probs=auto takes them as
    pi_old then), a ``returns_routed_experts`` one (whether it can hand back an MoE model's routes,
    Rollout.routed_experts, for moe.router_replay=R3), and is chosen by name through ENGINES."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams, *,
                 prompt_indices: Sequence[int] | None = None) -> list[list[Rollout]]:
        """n responses to each prompt: result[i][k] is sample k of prompt i, drawn from the stream
        sequence_seed(params.seed, prompt_indices[i], k). ``prompt_indices`` are the prompts'
        positions in the whole generation batch (default 0..len-1), so a replica that generates a
        share of the batch draws exactly what one engine generating all of it would. Every replica
        calls it for every generation batch, with ``prompt_ids=[]`` when its share is empty: an
        engine whose replicas step together (vLLM's data parallelism) takes part and returns []."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors named as in the HF checkpoint, e.g.
        ``model.layers.0.self_attn.q_proj.weight``; a subset is fine (bucketed streaming)."""
        ...

    def finish_weight_update(self) -> None:
        """Called once after the last update_weights of a sync: an engine that applies updates
        lazily (vLLM re-processes its layers) finishes here, so the next sync starts afresh."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) for the training phase."""
        ...

    def wake_up(self) -> None:
        """Undo sleep() before generating again."""
        ...

    def shutdown(self) -> None:
        """The end of the run (Run.close): release the engine while the process group it may use
        still exists."""
        ...

    def abort(self) -> None:
        """Called from another thread than the one generating (or, for a batch not begun, from that
        thread), when nobody will collect what it generates (an engine rank's stop, a cancelled
        batch: rollout/separate.py): a ``generate`` running now ends
        soon, raising GenerationAborted, and every later one at once, until ``clear_abort``. An
        engine that cannot stop a batch it has begun ignores it (its ``aborts`` class attribute is
        False): the batch finishes."""
        ...

    def clear_abort(self) -> None:
        """Undo ``abort`` for the next ``generate`` (called on the generating thread between two,
        when the batch aborted was cancelled and the engine serves on: rollout/separate.py)."""
        ...


def sequence_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of response ``sample_index`` of prompt ``prompt_index`` under base ``seed``.

    numpy's SeedSequence hashes the triple, so nearby triples give unrelated streams (a plain
    ``seed + index`` would make (seed, i + 1) replay (seed + 1, i)). 63 bits keep the value a
    valid non-negative int64 for torch generators and for vLLM's per-request seeds.
    """
    if min(seed, prompt_index, sample_index) < 0:
        raise ValueError(f"seed and indices must be >= 0, got {(seed, prompt_index, sample_index)}")
    state = np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def resolve_seed(seed: int | None) -> int:
    """``seed``, or a fresh one from torch's global generator (so torch.manual_seed pins it)."""
    if seed is not None:
        return seed
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def check_prompts(prompt_ids: Sequence[Sequence[int]], n: int,
                  prompt_indices: Sequence[int] | None = None) -> list[int]:
    """Shared argument checks of generate(): n >= 1, no empty prompt, one index per prompt.
    Returns the prompt indices (0..len-1 when None)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if prompt_indices is None:
        return list(range(len(prompt_ids)))
    if len(prompt_indices) != len(prompt_ids):
        raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompt_ids)} prompts")
    return [int(i) for i in prompt_indices]


# Engines are registered by import path so that looking up "hf" never imports vllm and looking
# up "vllm" fails only when it is used without vllm installed.
ENGINES: Registry = Registry("rollout engine")
ENGINES.register("hf")("megatron_dapo.rollout.hf_engine:HFEngine")
ENGINES.register("vllm")("megatron_dapo.rollout.vllm_engine:VLLMEngine")


class EngineClass(Protocol):
    """An engine class, before any engine of it exists: what set-up asks of it (RolloutEngine's
    docstring says what each member means)."""

    reads_hf_weights: bool
    continues_prefixes: bool
    fp32_logprobs_are_the_trainers: bool
    returns_routed_experts: bool
    aborts: bool

    def from_spec(self, spec: EngineSpec) -> RolloutEngine:
        ...

    def preflight(self, spec: EngineSpec) -> None:
        ...


def get_engine_cls(name: str) -> EngineClass:
    """The engine class registered as ``name`` ("hf", "vllm"); ValueError lists the names."""
    module_name, _, attr = ENGINES.get(name).partition(":")
    return getattr(importlib.import_module(module_name), attr)
