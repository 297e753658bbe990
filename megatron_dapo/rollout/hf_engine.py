"""Rollouts from a Hugging Face transformers causal LM: the CPU engine and the GPU-free reference.

The decode loop is written out (prefill, then one token per step through a DynamicCache) rather
than calling ``model.generate``, for three reasons: the log-probs must come from the raw logits
(``log_softmax(logits / T)``, before top-p / top-k), each response needs its own random stream
so that batching does not change it, and left padding must be exact.

Left padding. Prompts of a batch are right-aligned; pad positions get attention-mask 0 and the
real tokens get position ids 0, 1, 2, ... counted from the first real token, so a padded prompt
sees exactly the keys and rotary phases it would see alone. Measured on the tiny test model:
padded and unpadded logits agree to ~1e-7 (fp32 summation order), which the tests pin at 1e-5.

Sampling mirrors vLLM's sampler so the two engines draw from the same distribution: logits / T,
then top-k (ties with the k-th value kept), then top-p on the top-k-renormalised probabilities
(drop the tokens whose ascending cumulative mass is <= 1 - top_p, never the most likely one),
then an exponential race (argmax p_i / q_i, q_i ~ Exp(1)), which draws i with probability p_i
and consumes the same amount of randomness every step whatever the distribution.

Finished rows leave the decode batch once a quarter of its rows are done (KV cache, mask and the
race's draws are compacted together): a decode step's cost follows its rows, and responses often
end well before the longest. A row's logits then come from a smaller batch, which moves them by
fp32 summation order (~1e-7), as padding does. Not done: the n samples of a prompt each prefill the
prompt again; that costs compute, not correctness, and this engine is for CPU-sized models and for
checking the vLLM engine.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

from megatron_dapo.convert import fused_experts
from megatron_dapo.precision import resolve_dtype
from megatron_dapo.rollout.engine import (
    EngineSpec,
    GenerationAborted,
    Rollout,
    SamplingParams,
    check_prompts,
    resolve_seed,
    sequence_seed,
)
from megatron_dapo.rollout.gen_progress import GenerationCounter, ProgressSink
from megatron_dapo.rollout.routes import Routes


class HFEngine:
    """RolloutEngine over an in-memory ``transformers`` causal LM (e.g. Qwen2ForCausalLM).

    Args:
        model: the model; put in eval mode, weights updated in place by update_weights.
        eos_token_ids: ids that end a response (on top of each request's stop_token_ids);
            None reads ``generation_config.eos_token_id`` or ``config.eos_token_id``.
        pad_token_id: filler for left padding and for rows that have finished (never attended
            to or returned); None = the first EOS id, else 0.
        max_batch_size: responses decoded together; more are processed in chunks, which does not
            change any response (per-response random streams).
    """

    reads_hf_weights = True  # from_spec loads model.hf_path; the first sync replaces them
    continues_prefixes = True  # token ids in, token ids out: prompt + a response's prefix continues it
    fp32_logprobs_are_the_trainers = True  # the same math as the trainer's forward (max |diff| ~5e-6 at fp32)
    returns_routed_experts = True  # an MoE model's router indices, read from its gates as it decodes (RouteRecorder)
    aborts = True  # its decode loop checks for abort() at every token

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int] | None = None,
                 pad_token_id: int | None = None, max_batch_size: int = 256, return_routed_experts: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _model_eos_ids(model)
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        # transformers 5.x renamed forward's past_key_values to cache (the old name warns).
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._aborted = threading.Event()
        self.on_progress: ProgressSink | None = None  # rollout/gen_progress.py
        self._routes = RouteRecorder(model) if return_routed_experts else None

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, **kwargs) -> HFEngine:
        """Load a checkpoint directory with AutoModelForCausalLM; kwargs go to __init__."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), **kwargs)

    @staticmethod
    def preflight(spec: EngineSpec) -> None:
        """Nothing to check ahead: transformers is always installed and any head size works."""

    @classmethod
    def from_spec(cls, spec: EngineSpec, **kwargs) -> HFEngine:
        """The engine of a training run: the checkpoint in fp32 on the CPU, every rank a whole copy
        (no tensor parallelism: with rollout.tensor_parallel_size > 1 the ranks of a replica generate
        the same responses). Weights are replaced by the loop's first sync."""
        dtype = torch.bfloat16 if resolve_dtype(spec.dtype, torch.cuda.is_available()) == "bf16" else torch.float32
        return cls.from_pretrained(spec.model_path, dtype=dtype, return_routed_experts=spec.return_routed_experts,
                                   **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams, *,
                 prompt_indices: Sequence[int] | None = None) -> list[list[Rollout]]:
        """n responses per prompt; result[i][k] uses the stream sequence_seed(seed, prompt_indices[i], k)."""
        indices = check_prompts(prompt_ids, n, prompt_indices)
        seed = resolve_seed(params.seed)
        prompts = [list(p) for p in prompt_ids for _ in range(n)]
        seeds = [sequence_seed(seed, i, k) for i in indices for k in range(n)]
        flat = self.sample(prompts, seeds, params)
        return [flat[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
               params: SamplingParams) -> list[Rollout]:
        """One response per (prompt, seed) pair; the seed alone fixes the response's randomness.

        The building block of generate(), public so tests can check that batching, padding and
        chunking leave a response unchanged.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        out: list[Rollout] = []
        counter = GenerationCounter(self.on_progress, len(prompts), params.max_tokens)
        for start in range(0, len(prompts), self.max_batch_size):
            stop = start + self.max_batch_size
            part = self._sample_batch(prompts[start:stop], seeds[start:stop], params, counter)
            counter.part_done([len(r.response_ids) for r in part])
            out += part
        return out

    def _sample_batch(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                      params: SamplingParams, counter: GenerationCounter) -> list[Rollout]:
        device = next(self.model.parameters()).device
        num_seqs, max_len = len(prompts), max(len(p) for p in prompts)
        # Left padding: [B, L] ids and mask, real tokens right-aligned.
        ids_BL = torch.full((num_seqs, max_len), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros((num_seqs, max_len), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids_BL[b, max_len - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask_BL[b, max_len - len(p):] = 1
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        ids_BL, mask_BL, pos_BL = ids_BL.to(device), mask_BL.to(device), pos_BL.to(device)

        generators = [torch.Generator().manual_seed(s) for s in seeds]
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = [False] * num_seqs
        rows = list(range(num_seqs))  # the response of each batch row: rows leave as they finish
        cache = _new_cache(self.model.config)

        if self._aborted.is_set():  # a batch queued behind an aborted one: not even its prefill
            raise GenerationAborted("the HF engine was aborted before generating")
        logits_BV = self._forward(ids_BL, mask_BL, pos_BL, cache)
        routes = None
        if self._routes is not None:  # per response: [tokens fed so far, layers, k]
            prefill = self._routes.take(num_seqs)
            routes = [[prefill[b, max_len - len(p):]] for b, p in enumerate(prompts)]
        race = _RaceBlocks(generators, params.max_tokens, logits_BV.shape[-1])
        for step in range(params.max_tokens):
            if self._aborted.is_set():
                raise GenerationAborted("the HF engine was aborted while generating")
            live = [not finished[r] for r in rows]
            race_BV = race.at(step, live) if params.temperature else None  # greedy draws nothing
            tokens_B, logp_B = sample_next(logits_BV, params, race.generators, race_BV=race_BV)
            tokens, logps = tokens_B.tolist(), logp_B.tolist()  # one conversion, not one per row
            for i, r in enumerate(rows):
                if finished[r]:
                    continue
                responses[r].append(tokens[i])
                logprobs[r].append(logps[i])
                finished[r] = tokens[i] in stop_ids
            if all(finished) or step == params.max_tokens - 1:
                break
            if counter.due():
                counter.report(sum(finished), sum(map(len, responses)), step + 1)
            keep = [i for i, r in enumerate(rows) if not finished[r]]
            if 4 * len(keep) <= 3 * len(rows):  # compact: a decode step costs by its rows
                rows, keep_B = [rows[i] for i in keep], torch.tensor(keep)
                on_device = keep_B.to(device)
                cache.batch_select_indices(on_device)
                mask_BL, pos_BL, tokens_B = mask_BL[on_device], pos_BL[on_device], tokens_B[keep_B]
                race.keep(keep)  # and with it the rows' generators
            done_B = torch.tensor([finished[r] for r in rows])
            next_B1 = torch.where(done_B, self.pad_token_id, tokens_B).view(-1, 1)
            mask_BL = torch.cat([mask_BL, torch.ones_like(mask_BL[:, :1])], dim=1)
            pos_BL = pos_BL[:, -1:] + 1
            logits_BV = self._forward(next_B1.to(device), mask_BL, pos_BL, cache)
            if routes is not None:  # the token each live row was fed (finished rows were fed padding)
                fed = self._routes.take(len(rows))
                for i, r in enumerate(rows):
                    if not done_B[i]:
                        routes[r].append(fed[i])  # [1, layers, k]

        packed = [_routes(torch.cat(rs)) for rs in routes] if routes is not None else [None] * num_seqs
        return [
            Rollout(prompt_ids=list(p), response_ids=r, logprobs=lp if params.logprobs else [],
                    finish_reason="stop" if done else "length", routed_experts=re)
            for p, r, lp, done, re in zip(prompts, responses, logprobs, finished, packed)
        ]

    def _forward(self, ids_BS: torch.Tensor, mask_BL: torch.Tensor, pos_BS: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        """Feed [B, S] new tokens (mask covers all L cached + new positions); [B, V] last logits."""
        out = self.model(input_ids=ids_BS, attention_mask=mask_BL, position_ids=pos_BS,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return out.logits[:, -1, :]

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model's parameters and buffers, in place.

        All-or-nothing per call: every name and shape is checked before anything is copied, and
        a ValueError lists the unknown names and the shape mismatches. dtype and device are
        converted by copy_. For tied embeddings, ``lm_head.weight`` and
        ``model.embed_tokens.weight`` name the same tensor and either may be sent.
        """
        params = self.model.state_dict(keep_vars=True)
        items = list(weights)
        # checkpoint names; an MoE layer's per-expert tensors fill views of its fused parameters
        targets = {name: fused_experts.target(params, name) for name, _ in items}
        unknown = [name for name, _ in items if targets[name] is None]
        mismatched = [f"{name}: got {tuple(t.shape)}, model has {tuple(targets[name].shape)}"
                      for name, t in items if targets[name] is not None and t.shape != targets[name].shape]
        if unknown or mismatched:
            raise ValueError(
                "update_weights rejected the whole call (nothing copied): "
                + (f"unknown names {unknown} (model names look like {sorted(params)[:3]}); "
                   if unknown else "")
                + (f"shape mismatches {mismatched}" if mismatched else ""))
        with torch.no_grad():
            for name, tensor in items:
                targets[name].copy_(tensor)

    def finish_weight_update(self) -> None:
        """No-op: update_weights copies in place, nothing is pending."""

    def sleep(self) -> None:
        """No-op: on CPU there is no accelerator memory to hand to the trainer."""

    def wake_up(self) -> None:
        """No-op, see sleep()."""

    def shutdown(self) -> None:
        """No-op: nothing outlives the model, which is garbage like any other object."""

    def abort(self) -> None:
        """The running generate raises GenerationAborted at its next token, and every later one
        before its prefill, until clear_abort (RolloutEngine.abort)."""
        self._aborted.set()

    def clear_abort(self) -> None:
        """The next generate runs (RolloutEngine.clear_abort)."""
        self._aborted.clear()


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator], *,
                race_BV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and report its log-prob under log_softmax(logits / T).

    Args:
        logits_BV: [B, V] next-token logits (any float dtype, any device).
        params: temperature, top_p, top_k.
        generators: B CPU generators, one per row; row b consumes V exponentials per call.
        race_BV: [B, V] exponentials already drawn from those generators (``_RaceBlocks``), in
            place of drawing them here; the same numbers either way.

    Returns:
        tokens [B] int64 and logprobs [B] fp32, on the CPU.
    """
    x_BV = logits_BV.detach().float().cpu()
    if params.temperature == 0:
        tokens_B = x_BV.argmax(dim=-1)
        logp_BV = torch.log_softmax(x_BV, dim=-1)
    else:
        x_BV = x_BV / params.temperature
        logp_BV = torch.log_softmax(x_BV, dim=-1)
        probs_BV = torch.softmax(truncate_logits(x_BV, params.top_k, params.top_p), dim=-1)
        if race_BV is None:
            race_BV = torch.stack([torch.empty(x_BV.shape[-1]).exponential_(generator=g) for g in generators])
        tokens_B = (probs_BV / race_BV).argmax(dim=-1)
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


class _RaceBlocks:
    """The exponential race's randomness, drawn for several decode steps per call, for live rows only.

    A generator's draws are one sequence whatever the tensor shape (``empty(K, V).exponential_(g)``
    equals K draws of ``empty(V)``, row by row), so drawing K steps at once leaves every response's
    stream as it was, with one call per row per K steps instead of per step: per-call overhead was
    most of the sampler's time on the CPU demo. A finished row's generator is never read again, so
    its later blocks are not drawn (its race row is ones: its token is discarded). Blocks grow
    (``first``, then doubling) so that short responses do not pay for ``max_tokens`` steps of draws,
    and are capped so a block stays under ``budget`` floats.
    """

    def __init__(self, generators: Sequence[torch.Generator], max_tokens: int, vocab: int,
                 budget: int = 1 << 23, first: int = 8):
        self.generators, self.vocab, self.max_tokens = list(generators), vocab, max_tokens
        self.cap = max(1, min(max_tokens, budget // max(1, len(generators) * vocab)))
        self.block = min(first, self.cap)  # the size of the next block
        self._first, self._BKV = 0, torch.empty(len(self.generators), 0, vocab)  # no block drawn yet

    def at(self, step: int, live: Sequence[bool]) -> torch.Tensor:
        """[B, V] exponentials of decode step ``step`` (steps are asked for in order); ``live[b]``:
        row b still decodes (rows that do not are not drawn)."""
        if not self._first <= step < self._first + self._BKV.shape[1]:
            size = min(self.block, self.max_tokens - step)
            self._first, self._BKV = step, torch.ones(len(self.generators), size, self.vocab)
            for row, g in enumerate(self.generators):
                if live[row]:
                    self._BKV[row].exponential_(generator=g)
            self.block = min(2 * self.block, self.cap)
        return self._BKV[:, step - self._first]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these batch rows, in this order (the decode batch was compacted)."""
        self.generators = [self.generators[r] for r in rows]
        self._BKV = self._BKV[list(rows)]


def truncate_logits(x_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k / top-p support to -inf (vLLM's rule, see module doc).

    Args:
        x_BV: [B, V] temperature-scaled logits. Not modified.
        top_k: -1 = off.
        top_p: 1.0 = off.
    """
    vocab = x_BV.shape[-1]
    if top_k != -1 and top_k < vocab:
        kth_B1 = x_BV.topk(top_k, dim=-1).values[:, -1:]
        x_BV = x_BV.masked_fill(x_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = x_BV.sort(dim=-1, descending=False)
        cum_BV = torch.softmax(sorted_BV, dim=-1).cumsum(dim=-1)
        drop_BV = cum_BV <= 1 - top_p
        drop_BV[:, -1] = False  # the most likely token always stays
        x_BV = x_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    return x_BV


def _new_cache(config) -> DynamicCache:
    """An empty KV cache; transformers < 4.56 has no config argument (layers are made lazily)."""
    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()


def _model_eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """EOS ids from the generation config (Qwen2.5 lists two), else the model config."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


def _routes(fed: torch.Tensor) -> Routes:
    """A response's recorded routes, [tokens fed, layers, k] -> Rollout.routed_experts."""
    return Routes.of(fed, len(fed))


class RouteRecorder:
    """The experts an MoE model's gates choose, read with forward hooks on every layer's router
    (transformers' Qwen3-MoE ``mlp.gate`` returns (logits, weights, indices), indices [B x S, k] batch-major).
    ``take`` gives the last forward's as [B, S, layers, k] int16 and forgets them."""

    def __init__(self, model: torch.nn.Module):
        self.gates = [m for name, m in model.named_modules() if name.endswith(".mlp.gate")]
        if not self.gates:
            raise ValueError(f"{type(model).__name__} has no MoE router (.mlp.gate): nothing to record for "
                             "moe.router_replay=R3")
        self._last: list[torch.Tensor | None] = [None] * len(self.gates)
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(functools.partial(self._keep, layer))

    def _keep(self, layer: int, module, inputs, outputs) -> None:
        self._last[layer] = outputs[2]

    def take(self, batch: int) -> torch.Tensor:
        """The last forward's routes of its ``batch`` rows: [batch, S, layers, k]."""
        stacked = torch.stack([t.to(torch.int16) for t in self._last], dim=1)  # [B x S, layers, k]
        self._last = [None] * len(self.gates)
        return stacked.view(batch, -1, *stacked.shape[1:]).cpu()
