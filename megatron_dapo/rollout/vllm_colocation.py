"""What colocating an in-process vLLM engine with a trainer needs from vLLM's internals (0.32.0).

Kept apart from vllm_engine.py because each piece reaches past vLLM's public API and may need
revisiting when the pinned version changes (each is checked by tests/unit/test_rollout_vllm_engine.py
or tests/distributed/test_vllm_colocated.py):
- functions run inside each worker (``LLM.collective_rpc``) for a layerwise weight reload;
- ``restore_process_state``: undo what building an engine changes in the trainer's process;
- ``keep_world_on_shutdown``: an engine's shutdown must not destroy the trainer's process group;
- ``unique_cpu_shm_names``: colocated CPU engines must not share /dev/shm segment names;
- ``step_requests``: LLM.generate's loop (``LLM.llm_engine``'s step, abort_request), stepped by the
  engine so that an abort can end it, and ``tp_cpu_group`` for the ranks of a replica to agree on one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from megatron_dapo.rollout.gen_progress import GenerationCounter


# Module level so that they pickle by reference for standalone engines in child processes.
def begin_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.model_runner.get_model().load_weights(weights)
    return len(loaded) if loaded is not None else len(weights)


def finish_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.model_config)
        # A parameter shared by two modules (tied embeddings: lm_head.weight is
        # model.embed_tokens.weight) is reloaded through its first owner only; the other owner's
        # kernel state (the CPU build's packed GEMM of the output layer) is re-made from it here.
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                module = model.get_submodule(name.rpartition(".")[0])
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
            seen.add(id(param))


@contextlib.contextmanager
def restore_process_state(active: bool) -> Iterator[None]:
    """Put back what building an in-process vLLM engine changes in the trainer's process.

    vLLM replaces ``torch.set_num_threads`` by a no-op and drops torch to 1 thread, reseeds
    the global RNGs (python, numpy, torch) with its seed, and sets ``LD_PRELOAD`` / ``LOCAL_WORLD_SIZE``
    (CPU platform); all of these are put back after the engine is built. Left as vLLM sets them:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM itself sets it for external_launcher) and a few vLLM /
    inductor variables (NUMEXPR_MAX_THREADS, TORCHINDUCTOR_COMPILE_THREADS, VLLM_WORKER_MULTIPROC_METHOD).
    No thread binding happens in process (vLLM binds OpenMP threads only in its
    multiprocessing workers), so restoring torch.set_num_threads is safe."""
    if not active:
        yield
        return
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    rng = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    env = {key: os.environ.get(key) for key in ("LD_PRELOAD", "LOCAL_WORLD_SIZE")}
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.random.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def keep_world_on_shutdown(llm: Any) -> Callable[[], Any] | None:
    """Make the engine's shutdown spare torch.distributed's world; returns the shutdown to call.

    An in-process vLLM engine shuts down when its LLM is garbage-collected (or at exit), and
    EngineCore.shutdown ends with cleanup_dist_env_and_memory(), which destroys the default
    process group: colocated, that is the trainer's. The engine's finalizer is replaced by one
    that runs the same shutdown with only vLLM's own groups torn down.
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    core, finalizer = getattr(client, "engine_core", None), getattr(client, "_finalizer", None)
    if core is None or not isinstance(finalizer, weakref.finalize):
        return None
    finalizer.detach()
    client._finalizer = weakref.finalize(client, _shutdown_keeping_world, core)
    return client._finalizer


def _shutdown_keeping_world(core: Any) -> None:
    import vllm.v1.engine.core as core_module
    from vllm.distributed import parallel_state

    def destroy_vllm_groups(*args: Any, **kwargs: Any) -> None:
        if torch.distributed.is_initialized():  # else the world, and every group in it, is gone
            parallel_state.destroy_model_parallel()

    cleanup = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = destroy_vllm_groups
    try:
        core.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory = cleanup


_BUILDS = itertools.count()


@contextlib.contextmanager
def unique_cpu_shm_names(active: bool) -> Iterator[None]:
    """Give this engine's CPU shared-memory segments names of their own.

    vLLM's CPU build moves TP/PP collectives through POSIX shared memory named after the
    torch.distributed init method, which external_launcher fixes to "env://": every colocated
    engine on a machine would use the same names ("/dev/shm/-tp:0-[0-1]-cpushm_0"), so a second
    job, a second engine in the same processes, or the leftovers of a killed run fail with
    "create shm in SHMManager failed. errno: 17". The names get a token (rank 0's pid and a build
    counter, broadcast over the world: every rank builds the engine at the same point) while the
    engine's groups are created.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    original = shm.__dict__.get("make_group_name") if shm is not None else None
    if not active or not isinstance(original, staticmethod):
        yield
        return
    import torch.distributed as dist

    token = [f"{os.getpid()}.{next(_BUILDS)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    shm.make_group_name = staticmethod(lambda comm: f"{original.__func__(comm)}.{token[0]}")
    try:
        yield
    finally:
        shm.make_group_name = original


def tp_cpu_group() -> Any:
    """vLLM's gloo group of this rank's tensor-parallel replica (built with the engine)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def step_requests(engine: Any, ids: list[str], aborted: threading.Event, tp_group: Any = None,
                  counter: GenerationCounter | None = None) -> list[Any]:
    """Steps ``engine`` (an LLM's llm_engine) until the requests ``ids`` (``LLM.enqueue``'s, internal)
    finish, as LLM.generate does; their outputs in the order enqueued (vLLM's own sort: outputs carry
    the request counter's ids).

    Once ``aborted`` is set (from another thread) the requests end at the next step, ended by this
    thread, the only one that steps the engine, and GenerationAborted is raised. With ``tp_group``
    (external launcher, TP > 1) the replica's ranks agree on it first, one all-reduce a step: each
    runs a scheduler of its own, and a rank ending its requests a step before the others would leave
    them in a forward it never joins. The loop keeps stepping while another data-parallel replica
    has requests (``has_unfinished_requests`` is a collective of the DP group, hung by a replica that
    left): at a stop every replica is aborted, so they leave together. Finished ids are ignored by
    abort_request. ``counter`` (rollout/gen_progress.py) is told how far they are when it is due.
    """
    from megatron_dapo.rollout.engine import GenerationAborted

    finished, aborting, done_tokens, longest = [], False, 0, 0
    while True:
        if not aborting and _any_rank(aborted.is_set(), tp_group):
            engine.abort_request(ids, internal=True)
            aborting = True
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
        ended = [out for out in outs if out.finished]
        finished += ended
        if counter is not None:
            done_tokens += sum(len(out.outputs[0].token_ids) for out in ended)
            if counter.due():  # a request's output holds all its tokens so far
                running = [len(out.outputs[0].token_ids) for out in outs if out.outputs and not out.finished]
                longest = max([longest, *running, *(len(out.outputs[0].token_ids) for out in ended)])
                counter.report(len(finished), done_tokens + sum(running), longest)
    if aborting:
        raise GenerationAborted("the vLLM engine was aborted while generating")
    return sorted(finished, key=lambda out: int(out.request_id))


def _any_rank(flag: bool, group: Any) -> bool:
    """``flag`` or-ed over ``group``'s ranks (a collective of the group); ``flag`` without one."""
    if group is None:
        return flag
    box = torch.tensor([int(flag)])
    torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(box.item())
