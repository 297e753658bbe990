"""Training checkpoints: megatron dist checkpoints (torch_dist) plus RNG and trainer state, saved atomically.

The files, the manifest, the crash-safety of a save and the fallback on damage are in
mcore/checkpoint_files.py (re-exported here). A save has two phases, so that the trainer can write
the heavy part while the rollout engine sleeps and make it visible later, once the step is logged:

* ``write_checkpoint`` (collective): model, optimizer and lr schedule into ``step_N.tmp/``
  (dist_checkpointing.save); returns a ``PendingCheckpoint``. Nothing is visible yet: a crash or a
  stop before the publish leaves the previous checkpoint as ``latest``.
* ``publish_checkpoint`` (collective): each rank's RNG states as they are *then* (an uninterrupted
  run goes on from those states, so a resumed one must restore the same), the trainer state, the
  manifest (checkpoint.json, last), the rename into ``step_N/``, ``latest``, pruning.

``save_checkpoint`` is the two in a row.

With ``background=True`` (``checkpoint.async_save``) the write's files are written by a child
process (mcore/checkpoint_background.py): ``write_checkpoint`` returns once the tensors are staged
on the host, ``write_finished`` tells (collectively) whether every rank's child is done, and
``publish_checkpoint`` first finishes the write (waiting for it when it is not). The RNG states and
the trainer state it publishes are the caller's, taken when the step ended (``rng_state``).

Resharding: model and optimizer tensors are global, keyed by Megatron name, so a checkpoint
loads at another TP / PP / DP (dist checkpointing reshards). The distributed optimizer is
saved in megatron's ``fully_reshardable`` format (megatron-training's choice for that reason;
its default ``dp_reshardable`` reshards only over DP). Saving and loading must agree on
``use_distributed_optimizer``. RNG states are per rank: they are restored only when the layout
is unchanged; otherwise each rank keeps the freshly seeded ones (as megatron-training does).

Host memory (docs/checkpoints_memory.md): to build the ``fully_reshardable`` state,
megatron-core 0.19.2 gathers the fp32 param + Adam moments of a whole TP x PP shard into CPU
tensors, by default on *every* DP rank (an all_gather over the DP group, distrib_optimizer.py:1729-1738,
1315-1395), although only the DP-rank-0 copy is written (the others are not main replicas).
``memory_efficient=True`` sets megatron's ``distrib_optim_fully_reshardable_mem_efficient``: a
gather over the gloo DP group to DP rank 0 only; the other DP ranks hold just their own shard. DP
rank 0 still holds the whole gathered state. The files are the same and the load ignores the flag.

No Manager process: megatron's writer hands its write results back through a queue it would get
from a ``multiprocessing.Manager`` (a server process, ~270 MB, spawned on the first save), which
its own asynchronous save needs, since there the writing runs in another process. A one-phase save
writes in this process (with threads), so an in-process queue does the same job; a background
write's child leaves its results in a file (mcore/checkpoint_background.py). A killed trainer
leaves no process behind: no Manager, no multiprocessing resource tracker, no writer
(tests/functional/test_faults.py, test_async_save.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.errors import InputError, one_line
from megatron_dapo.mcore import checkpoint_background as background_write
from megatron_dapo.mcore import checkpoint_files as files
from megatron_dapo.mcore.checkpoint_files import (
    FORMAT_VERSION, LATEST, META, MOE_SHAPE_FIELDS, SHAPE_FIELDS, TRAINER_STATE, check_model_shape, checkpoint_name,
    damage,
    is_complete, latest_checkpoint, list_checkpoints, read_meta, read_trainer_state, why_none_usable)

__all__ = ["FORMAT_VERSION", "LATEST", "META", "SHAPE_FIELDS", "TRAINER_STATE", "PendingCheckpoint",
           "check_loadable", "check_model_shape", "checkpoint_name", "damage", "in_process_write_results",
           "is_complete", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "model_shape",
           "model_sharded_state_dict", "publish_checkpoint",
           "read_meta", "read_trainer_state", "rng_state", "save_checkpoint", "why_none_usable", "write_checkpoint",
           "write_finished"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint whose tensors are written (``tmp``) but not yet published as ``final``. The
    fields that describe the saved tensors are fixed here, at write time."""
    root: Path
    step: int
    tmp: Path
    final: Path
    layout: dict
    model_shape: dict
    padded_vocab_size: int
    distributed_optimizer: bool | None  # None: no optimizer state saved
    memory_efficient: bool  # megatron's distrib_optim_fully_reshardable_mem_efficient was set
    write: int = 0  # this process's write count when it was written (publish_checkpoint's check)
    background: background_write.BackgroundWrite | None = None  # a child writes the files; None: written


# Writes in this process; a pending checkpoint may be published only while it is the last one
# written and not yet published. Kept in memory (every rank counts the same collective calls), not
# read from the file system, where one rank's stale view would leave the others in the barrier.
_WRITES = {"count": 0, "published": 0}


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _layout() -> dict:
    from megatron.core import parallel_state as ps
    return dict(world_size=dist.get_world_size(), tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
                ep=ps.get_expert_model_parallel_world_size())


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return any(isinstance(p, DistributedOptimizer) for p in parts)


def _sharded_state_dict(model, optimizer, scheduler, *, is_loading: bool,
                        memory_efficient: bool = False) -> dict:
    """``memory_efficient`` matters only for a save with the distributed optimizer: when loading,
    megatron builds the full (empty) state on every rank either way (distrib_optimizer.py:1738),
    so the load uses the default, which needs no gloo group."""
    from megatron.core import parallel_state as ps
    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": memory_efficient,
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    chunks = [_unwrap(c) for c in model]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = {k: c.sharded_state_dict(metadata=metadata) for k, c in zip(keys, chunks)}
    if optimizer is not None:
        if not _uses_distributed_optimizer(optimizer):
            metadata.pop("distrib_optim_sharding_type")
            metadata.pop("distrib_optim_fully_reshardable_mem_efficient")
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def rng_state() -> dict:
    """This rank's RNG states (Python, NumPy, torch, CUDA, megatron's tracker), as a publish saves them."""
    from megatron.core import tensor_parallel
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def model_shape(model: list) -> dict:
    """The architecture numbers a checkpoint must share with the model that loads it: the
    TransformerConfig's, and the vocabulary before padding (model.build_model's hf_vocab_size)."""
    chunk = _unwrap(model[0])
    shape = {k: chunk.hf_vocab_size if k == "vocab_size" else getattr(chunk.config, k) for k in SHAPE_FIELDS}
    dense = not chunk.config.num_moe_experts
    return {**shape, **{k: 0 for k in MOE_SHAPE_FIELDS if dense}}  # as model.hf_arch says for a dense model


def _publish_args(trainer_state: dict, keep_last: int) -> str:
    """trainer_state as JSON; checked before anything is written."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    try:
        return json.dumps(trainer_state)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable: {e}") from e


def save_checkpoint(root: str | os.PathLike, step: int, *, model: list, optimizer, scheduler,
                    trainer_state: dict, keep_last: int, memory_efficient: bool = True) -> Path:
    """Save on every rank (collective): write_checkpoint then publish_checkpoint; returns the
    checkpoint's directory."""
    _publish_args(trainer_state, keep_last)  # a bad trainer state fails before the heavy write
    pending = write_checkpoint(root, step, model=model, optimizer=optimizer, scheduler=scheduler,
                               memory_efficient=memory_efficient)
    return publish_checkpoint(pending, trainer_state=trainer_state, keep_last=keep_last)


def write_checkpoint(root: str | os.PathLike, step: int, *, model: list, optimizer, scheduler,
                     memory_efficient: bool = True, background: bool = False) -> PendingCheckpoint:
    """Write model, optimizer and lr schedule into ``<root>/step_N.tmp`` on every rank
    (collective); nothing is published until publish_checkpoint. ``memory_efficient``: gather
    the distributed optimizer's state on DP rank 0 only (see the module docstring).
    ``background``: return once the tensors are staged on the host; a child process writes them."""
    from megatron.core import dist_checkpointing

    root, rank = Path(root), dist.get_rank()
    final, tmp = root / checkpoint_name(step), root / (checkpoint_name(step) + ".tmp")
    if rank == 0:
        files.remove_leftovers(root, ("tmp",))  # a crashed or never-published save, this step's too
        tmp.mkdir(parents=True)
    dist.barrier()
    in_process_write_results()
    dist_opt = None if optimizer is None else _uses_distributed_optimizer(optimizer)
    memory_efficient = memory_efficient and bool(dist_opt)  # the flag means nothing to other optimizers
    sharded = _sharded_state_dict(model, optimizer, scheduler, is_loading=False,
                                  memory_efficient=memory_efficient)
    common = _without_ungathered if memory_efficient else None
    writing = None
    if background:
        request = dist_checkpointing.save(sharded, str(tmp), preprocess_common_before_consistancy_check=common,
                                          async_sharded_save=True, async_strategy="mcore")
        writing = background_write.start(request, tmp)
    else:
        dist_checkpointing.save(sharded, str(tmp), preprocess_common_before_consistancy_check=common)
    del sharded  # the gathered optimizer state (fully_reshardable): gone before the caller goes on
    if writing is None:
        dist.barrier()  # every rank's tensors are on disk
    _WRITES["count"] += 1
    return PendingCheckpoint(root=root, step=step, tmp=tmp, final=final, layout=_layout(),
                             model_shape=model_shape(model), padded_vocab_size=_unwrap(model[0]).vocab_size,
                             distributed_optimizer=dist_opt, memory_efficient=memory_efficient,
                             write=_WRITES["count"], background=writing)


def write_finished(pending: PendingCheckpoint) -> bool:
    """Whether ``pending``'s files are written on every rank (collective when a child writes them):
    a publish now would not wait."""
    writing = pending.background
    # every rank of a background write asks (a rank without files to write answers that it is done)
    return writing is None or writing.request is None or background_write.all_done(writing)


def _finish_write(pending: PendingCheckpoint) -> None:
    """A background write's end (collective): its child joined, the metadata written."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writing = pending.background
    if writing is None or writing.request is None:
        return
    try:
        background_write.finish(writing, filesystem_async._results_queue)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the latter is a BaseException
        raise RuntimeError(f"{pending.tmp}: writing it in the background failed ({_failures(e)}); nothing was "
                           "published, the newest checkpoint is the one before") from e
    finally:
        writing.request = None  # its finalize functions ran (or failed): never again
    dist.barrier()  # every rank's tensors are on disk
    logger.info("checkpoint step %d: written in the background in %.2f s after %.2f s of staging; the "
                "publish waited %.2f s for it", pending.step, writing.write_s, writing.staged_s, writing.waited_s)


def _without_ungathered(common: dict) -> dict:
    """The common state dict for megatron's cross-rank consistency check, less the None that the
    memory-efficient gather leaves as ``param_state`` on DP ranks > 0 (rank 0's went into the
    sharded part): without this, every such rank warns on every save that it differs from rank 0."""
    if not isinstance(common, dict):
        return common
    return {k: _without_ungathered(v) for k, v in common.items() if not (k == "param_state" and v is None)}


def _failures(e: BaseException) -> str:
    """megatron's CheckpointException in one line: each failed rank's error (the coordinator knows
    them; the other ranks learn only that a rank failed)."""
    if not isinstance(e, CheckpointException):
        return one_line(e)
    return "; ".join(f"rank {rank}: {one_line(exc)}" for rank, (exc, _) in sorted(e.failures.items())) or \
        "another rank's writer failed (rank 0's error names it)"


def publish_checkpoint(pending: PendingCheckpoint, *, trainer_state: dict, keep_last: int,
                       rng: dict | None = None) -> Path:
    """Make a written checkpoint the newest one (collective): every rank's RNG states (``rng``, this
    rank's taken by rng_state() when the step ended; None: as they are now), ``trainer_state``, the
    manifest, the rename into place, ``latest``, then prune to the newest ``keep_last``. A write in
    the background is finished first (waited for when it is not). Returns the checkpoint's directory."""
    trainer_json = _publish_args(trainer_state, keep_last)
    rank = dist.get_rank()
    if pending.write != _WRITES["count"] or _WRITES["published"] == pending.write:  # a later write removed it
        raise ValueError(f"{pending.tmp} holds no written checkpoint: publish a PendingCheckpoint once, "
                         "before the next write_checkpoint")
    _WRITES["published"] = pending.write  # consumed, also when its background write failed
    _finish_write(pending)
    (pending.tmp / "rng").mkdir(exist_ok=True)  # after the save, which warns about a non-empty directory
    with open(pending.tmp / "rng" / f"rank_{rank:05d}.pt", "wb") as f:
        torch.save(rng if rng is not None else rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()  # every rank's files are written
    if rank == 0:
        files.write_text(pending.tmp / TRAINER_STATE, trainer_json)
        meta = dict(format_version=FORMAT_VERSION, step=pending.step, layout=pending.layout,
                    model_shape=pending.model_shape, padded_vocab_size=pending.padded_vocab_size,
                    distributed_optimizer=pending.distributed_optimizer,
                    memory_efficient_save=pending.memory_efficient, files=files.manifest(pending.tmp))
        files.write_text(pending.tmp / META, json.dumps(meta, indent=1, sort_keys=True))
        files.publish(pending.root, pending.tmp, pending.final)
        files.prune(pending.root, keep_last, keep=pending.final)
    dist.barrier()
    return pending.final


def in_process_write_results() -> None:
    """Gives megatron's file writer a plain queue before it creates a Manager for one (see the
    module docstring); a no-op once set."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def model_sharded_state_dict(model: list) -> dict:
    """The model's part of what a training checkpoint holds: {"model": ShardedTensors ...} (or
    "model0", "model1", ... per virtual stage), as write_checkpoint saves it and load_checkpoint
    asks for it. Its tensor keys are global: no "model." prefix, as a converted checkpoint's."""
    return _sharded_state_dict(model, None, None, is_loading=True)


def check_loadable(path: str | os.PathLike, *, model: list) -> dict:
    """The manifest (checkpoint.json) of the complete checkpoint ``path`` once its weights are known
    to load into ``model``: intact, of the model's shape and vocabulary padding; InputError
    otherwise."""
    path = Path(path)
    if (why := damage(path)) is not None:
        raise InputError(f"checkpoint {path} is damaged ({why}); load another one")
    meta = read_meta(path)
    check_model_shape(path, meta, model_shape(model))
    if meta["padded_vocab_size"] != _unwrap(model[0]).vocab_size:
        # The padding depends on make_vocab_size_divisible_by (and on TP when that does not
        # divide it, model.padded_vocab_size); the dist-checkpoint loader would only report a
        # shape mismatch deep inside. A checkpoint that records its vocab_size passed the
        # comparison above, so only the padding differs; an older one may hold another model's.
        padding = "model.make_vocab_size_divisible_by it was saved with (and a TP that divides it)"
        fix = (f"load with the {padding}" if "vocab_size" in (meta.get("model_shape") or {}) else
               f"load with the model it was trained with (model.hf_path: its vocab_size) and the {padding}")
        raise InputError(f"checkpoint {path} holds a vocabulary padded to {meta['padded_vocab_size']} rows, this "
                         f"model pads to {_unwrap(model[0]).vocab_size}: {fix}")
    return meta


def load_checkpoint(path: str | os.PathLike, *, model: list, optimizer=None, scheduler=None,
                    load_rng: bool = True) -> dict | None:
    """Load a checkpoint (a ``step_*`` directory, or a root: its latest) into ``model`` and, when
    given, ``optimizer`` and ``scheduler``; collective. Returns the trainer state, or None when
    a root holds no checkpoint yet.

    A plain model checkpoint (megatron_dapo.convert's hf_to_megatron output: no checkpoint.json)
    loads the weights only and returns {}."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not is_complete(path):
        if (path / "metadata.json").is_file():  # a model-only dist checkpoint
            sharded = _sharded_state_dict(model, None, None, is_loading=True)
            try:
                state = dist_checkpointing.load(sharded, str(path))
            except Exception as e:  # noqa: BLE001 - megatron raises several types for one problem
                raise InputError(f"{path}: cannot load it into this model ({one_line(e)}); is it a "
                                 "checkpoint of this model.hf_path's architecture?") from None
            _load_model(model, state)
            return {}
        path = latest_checkpoint(path)
        if path is None:
            return None
    meta = check_loadable(path, model=model)
    if optimizer is not None and meta["distributed_optimizer"] is None:
        raise ValueError(f"{path} holds no optimizer state; load it without an optimizer")
    if optimizer is not None and meta["distributed_optimizer"] != _uses_distributed_optimizer(optimizer):
        raise ValueError(f"{path} was saved with use_distributed_optimizer={meta['distributed_optimizer']}; "
                         "load it with the same setting (or without the optimizer)")
    saved_ep, ep = meta["layout"].get("ep", 1), _layout()["ep"]
    if optimizer is not None and (saved_ep > 1) != (ep > 1):
        # megatron-core 0.19.2 gives the experts an optimizer of their own only under expert
        # parallelism (tensor_parallel/layers.py: allreduce=False): the saved state has another structure
        raise InputError(f"checkpoint {path} was saved at parallel.expert_model_parallel_size={saved_ep}; its "
                         f"optimizer state does not load at {ep} (megatron-core keeps the experts' state apart only "
                         f"when EP > 1): resume at EP {'> 1' if saved_ep > 1 else '= 1'}, or start a new run from "
                         "its weights (model.checkpoint)")
    with _torch_adam_load_fixes(optimizer):
        sharded = _sharded_state_dict(model, optimizer, None, is_loading=True)
        state = dist_checkpointing.load(sharded, str(path))
        _load_model(model, state)
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.num_steps = 0  # load_state_dict advances by the saved count: from 0, not from here
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        if {"ep": 1, **meta["layout"]} == _layout():  # checkpoints before EP was recorded: EP 1
            with open(path / "rng" / f"rank_{dist.get_rank():05d}.pt", "rb") as f:
                _set_rng_state(torch.load(f, weights_only=False))
        else:
            logger.warning("parallel layout changed (%s -> %s): RNG states not restored",
                           meta["layout"], _layout())
    return read_trainer_state(path)


@contextlib.contextmanager
def _torch_adam_load_fixes(optimizer):
    """Two gaps of megatron-core 0.19.2's DistributedOptimizer over torch's AdamW (what it uses
    without TE / apex, e.g. on CPU), where ``step`` is per-parameter optimizer state:
    * ``state_dict()`` asserts that all params share one ``step`` (distrib_optimizer.py:838-839),
      which fails before the first update (no state yet): give every param the state AdamW would
      create (step 0, zero moments) before the load builds its state dict;
    * ``load_state_dict`` first puts the loaded ``step`` into each param's state (:1024-1031),
      then every load_parameter_state_* path drops ``step`` from the tensors it copies (:2108,
      :2390) while ``_set_main_param_and_optimizer_states`` looks every state key up (:1223):
      KeyError 'step'. Offering ``step`` as a non-tensor makes that copy skip it, keeping the
      loaded step;
    * that loaded ``step`` is one tensor shared by every param's state (:1028-1032), and AdamW
      increments it in place once per param: after N params the bias correction of the next
      update used step + N. Each param gets its own copy."""
    from megatron.core.optimizer import ChainedOptimizer, distrib_optimizer

    parts = [] if optimizer is None else (
        optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer])
    patched = [p for p in parts if isinstance(p, distrib_optimizer.DistributedOptimizer)]
    if distrib_optimizer.HAVE_APEX_OR_TE:
        patched = []
    for part in patched:
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))
        original = part._set_main_param_and_optimizer_states
        part._set_main_param_and_optimizer_states = (  # an instance attribute, shadowing the method
            lambda param, tensors, _original=original: _original(param, {"step": None, **tensors}))
    try:
        yield
        for part in patched:
            for state in part.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states  # the instance attribute; the class method returns


def _load_model(model: list, state: dict) -> None:
    chunks = [_unwrap(c) for c in model]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(state[key])
