"""Training checkpoints: megatron dist checkpoints (torch_dist) plus RNG and trainer state, saved atomically.

Layout under the checkpoint root:
    latest                       the name of the newest complete checkpoint (replaced atomically)
    step_00000012/               one complete checkpoint:
        metadata.json, common.pt, *.distcp   megatron.core.dist_checkpointing: {"model" (or
                                 "model0", "model1", ... with virtual pipelining), "optimizer",
                                 "opt_param_scheduler"}
        rng/rank_00000.pt        python / numpy / torch / CUDA RNG and megatron's tracker, per rank
        trainer_state.json       the caller's dict (sampler position etc.), JSON
        checkpoint.json          step, parallel layout, optimizer kind, model shape and the size
                                 of every other file (the manifest); written last
    step_00000012.tmp/           a save in progress; renamed into place once every rank is done

A checkpoint is used only when it is complete and intact: every file of its manifest is there with
its recorded size, and its JSON files parse. A damaged one (a file truncated or deleted after the
save, by a full disk or a bad copy) is passed over with a warning naming the file, and resume falls
back to the newest intact checkpoint. The fallback deletes nothing: the damaged copy goes only when
the run saves that step again or pruning reaches it. When every saved checkpoint is damaged,
resuming is refused (``why_none_usable`` names each one and its file) instead of starting over.

A crash at any point of a save leaves ``latest`` and the previous checkpoints untouched; the
stray ``.tmp`` directory is removed by the next successful save, which then deletes all but
the newest ``keep_last`` checkpoints. (Re-saving an existing step moves the old copy aside
first: a crash between those two renames leaves ``latest`` dangling, and loading falls back to
the newest complete checkpoint.)

Resharding: model and optimizer tensors are global, keyed by Megatron name, so a checkpoint
loads at another TP / PP / DP (dist checkpointing reshards). The distributed optimizer is
saved in megatron's ``fully_reshardable`` format (megatron-training's choice for that reason;
its default ``dp_reshardable`` reshards only over DP). Saving and loading must agree on
``use_distributed_optimizer``. RNG states are per rank: they are restored only when the layout
is unchanged; otherwise each rank keeps the freshly seeded ones (as megatron-training does).

No helper process: megatron's writer hands its write results back through a queue it would get
from a ``multiprocessing.Manager`` (a server process, ~270 MB, spawned on the first save), which
only an asynchronous save needs, since there the writing runs in another process. Our saves are
synchronous (a sync ``dist_checkpointing.save`` always writes in this process, with threads), so
an in-process queue does the same job, and a killed trainer leaves no writer (nor the
multiprocessing resource tracker the Manager kept alive) behind (tests/functional/test_faults.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_dapo.errors import InputError, one_line

logger = logging.getLogger(__name__)

LATEST = "latest"
META = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 2  # 2: adds the manifest ("files") and "model_shape"
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                "kv_channels")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _layout() -> dict:
    from megatron.core import parallel_state as ps
    return dict(world_size=dist.get_world_size(), tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size())


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return any(isinstance(p, DistributedOptimizer) for p in parts)


def _sharded_state_dict(model, optimizer, scheduler, *, is_loading: bool) -> dict:
    from megatron.core import parallel_state as ps
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    chunks = [_unwrap(c) for c in model]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = {k: c.sharded_state_dict(metadata=metadata) for k, c in zip(keys, chunks)}
    if optimizer is not None:
        if not _uses_distributed_optimizer(optimizer):
            metadata.pop("distrib_optim_sharding_type")
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _rng_state() -> dict:
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


def _write_text(path: Path, text: str) -> None:
    """Write, flush and fsync (so that the later rename never publishes an empty file)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: Path) -> bool:
    return (Path(path) / META).is_file()


def read_meta(path: str | os.PathLike) -> dict | None:
    """checkpoint.json of a checkpoint directory; None when missing or unreadable."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None


def damage(path: str | os.PathLike) -> str | None:
    """Why a complete checkpoint cannot be used (a file missing or of the wrong size, JSON that
    does not parse), or None when it is intact. Checkpoints without a manifest (format 1) are
    checked for their JSON files only."""
    path = Path(path)
    meta = read_meta(path)
    if not isinstance(meta, dict):
        return f"{META} is unreadable"
    if not isinstance(meta.get("format_version", 1), int) or meta.get("format_version", 1) > FORMAT_VERSION:
        return (f"{META} has format_version {meta.get('format_version')!r}, newer than this version reads "
                f"({FORMAT_VERSION}): resume it with the megatron-dapo that wrote it")
    for name, size in meta.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if (found := file.stat().st_size) != size:
            return f"{name} has {found} bytes, the save wrote {size}"
    try:
        json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return f"{TRAINER_STATE} is unreadable"
    return None


def check_model_shape(path: Path, meta: dict, shape: dict, *, fix: str = "resume with the model it was trained "
                      "with, or start a new logging.dir") -> None:
    """InputError naming both shapes when a checkpoint was saved from another architecture."""
    saved = meta.get("model_shape")
    if saved is not None and saved != shape:
        diff = ", ".join(f"{k} {saved.get(k)} -> {shape.get(k)}" for k in SHAPE_FIELDS if saved.get(k) != shape.get(k))
        raise InputError(f"checkpoint {path} holds another model shape ({diff}; checkpoint -> this run's "
                         f"model): {fix}")


def model_shape(model: list) -> dict:
    """The architecture numbers a checkpoint must share with the model that loads it."""
    config = _unwrap(model[0]).config
    return {k: getattr(config, k) for k in SHAPE_FIELDS}


def _manifest(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and is_complete(p)]
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names if it is complete and intact; else the newest one that is
    (a crash between the rename and the pointer update, a damaged file), with a warning; None
    when there is none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if not is_complete(named):
            logger.warning("%s names %s, which is not a complete checkpoint; using the newest intact one",
                           pointer, named.name)
        elif damage(named) is None:
            return named
    for _, path in reversed(list_checkpoints(root)):  # a damaged named one is reported here
        why = damage(path)
        if why is None:
            return path
        logger.warning("checkpoint %s is damaged (%s): passing over it, not deleting it", path, why)
    return None


def why_none_usable(root: str | os.PathLike) -> str | None:
    """When ``root`` holds saved checkpoints but latest_checkpoint() finds none intact: what is wrong
    with each ("step_00000010: model.distcp has 100 bytes, the save wrote 4096; ..."); None when a
    checkpoint is intact or none was ever saved (no ``latest`` pointer, no complete checkpoint).
    A crashed save (a ``.tmp`` directory) never counts: it was never published."""
    root = Path(root)
    found = list_checkpoints(root)
    problems = [f"{path.name}: {why}" for _, path in found if (why := damage(path)) is not None]
    if len(problems) < len(found):
        return None
    pointer = root / LATEST
    if pointer.is_file():
        named = pointer.read_text().strip()
        if not any(path.name == named for _, path in found):
            problems.append(f"{LATEST} names {named}, which is {'incomplete' if (root / named).exists() else 'missing'}")
    return "; ".join(problems) or None


def save_checkpoint(root: str | os.PathLike, step: int, *, model: list, optimizer, scheduler,
                    trainer_state: dict, keep_last: int) -> Path:
    """Save on every rank (collective); returns the checkpoint's directory."""
    from megatron.core import dist_checkpointing

    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    try:
        trainer_json = json.dumps(trainer_state)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable: {e}") from e
    root, rank = Path(root), dist.get_rank()
    final, tmp = root / checkpoint_name(step), root / (checkpoint_name(step) + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    in_process_write_results()
    dist_checkpointing.save(_sharded_state_dict(model, optimizer, scheduler, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)  # after the save, which warns about a non-empty directory
    with open(tmp / "rng" / f"rank_{rank:05d}.pt", "wb") as f:
        torch.save(_rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()  # every rank's files are written
    if rank == 0:
        _write_text(tmp / TRAINER_STATE, trainer_json)
        dist_opt = None if optimizer is None else _uses_distributed_optimizer(optimizer)
        meta = dict(format_version=FORMAT_VERSION, step=step, layout=_layout(), model_shape=model_shape(model),
                    padded_vocab_size=_unwrap(model[0]).vocab_size, distributed_optimizer=dist_opt,
                    files=_manifest(tmp))
        _write_text(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
        _publish(root, tmp, final)
        _prune(root, keep_last, keep=final)
    dist.barrier()
    return final


def in_process_write_results() -> None:
    """Gives megatron's file writer a plain queue before it creates a Manager for one (see the
    module docstring); a no-op once set."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished save into place, then point ``latest`` at it (write + rename)."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # re-saving a step: move the previous copy aside, drop it afterwards
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    pointer_tmp = root / (LATEST + ".tmp")
    _write_text(pointer_tmp, final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)
    if old.exists():
        shutil.rmtree(old)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.iterdir():  # leftovers of crashed saves
        stem, _, suffix = path.name.rpartition(".")
        if path.is_dir() and suffix in ("tmp", "old") and _NAME.match(stem):
            shutil.rmtree(path, ignore_errors=True)


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
    elif (why := damage(path)) is not None:
        raise InputError(f"checkpoint {path} is damaged ({why}); load another one")
    meta = read_meta(path)
    check_model_shape(path, meta, model_shape(model))
    if meta["padded_vocab_size"] != _unwrap(model[0]).vocab_size:
        # The padding depends on make_vocab_size_divisible_by (and on TP when that does not
        # divide it, model.padded_vocab_size); the dist-checkpoint loader would only report a
        # shape mismatch deep inside.
        raise ValueError(f"{path} holds a vocabulary padded to {meta['padded_vocab_size']} rows, this "
                         f"model pads to {_unwrap(model[0]).vocab_size}: load with the "
                         f"make_vocab_size_divisible_by it was saved with, and a TP that divides it")
    if optimizer is not None and meta["distributed_optimizer"] is None:
        raise ValueError(f"{path} holds no optimizer state; load it without an optimizer")
    if optimizer is not None and meta["distributed_optimizer"] != _uses_distributed_optimizer(optimizer):
        raise ValueError(f"{path} was saved with use_distributed_optimizer={meta['distributed_optimizer']}; "
                         "load it with the same setting (or without the optimizer)")
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
        if meta["layout"] == _layout():
            with open(path / "rng" / f"rank_{dist.get_rank():05d}.pt", "rb") as f:
                _set_rng_state(torch.load(f, weights_only=False))
        else:
            logger.warning("parallel layout changed (%s -> %s): RNG states not restored",
                           meta["layout"], _layout())
    return read_trainer_state(path)


def read_trainer_state(path: str | os.PathLike) -> dict:
    """The caller's dict saved with a checkpoint (plain JSON: readable before anything is built)."""
    return json.loads((Path(path) / TRAINER_STATE).read_text())


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
