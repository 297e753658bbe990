"""The files of a training checkpoint and how a save becomes visible: naming, the manifest, the
checks that make a checkpoint usable, the rename into place, ``latest`` and pruning. No megatron
and no collectives here: mcore/checkpoint.py writes the tensors and calls these on rank 0.

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

A crash at any point of a save (also between checkpoint.write_checkpoint and publish_checkpoint)
leaves ``latest`` and the previous checkpoints untouched: a ``.tmp`` directory is never listed.
The next write removes stray ``.tmp`` directories before it starts (their space is free again
for the new one), and the next publish deletes all but the newest ``keep_last`` checkpoints.
(Re-saving an existing step moves the old copy aside first: a crash between those two renames
leaves ``latest`` dangling, and loading falls back to the newest complete checkpoint.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from megatron_dapo.errors import InputError

logger = logging.getLogger(__name__)

LATEST = "latest"
META = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 2  # 2: adds the manifest ("files") and "model_shape"
# add_qkv_bias and qk_layernorm tell Qwen2 from Qwen3; vocab_size (the HF config's, before padding) tells a
# model of another tokenizer, whose padded embedding may even have the same rows. check_model_shape compares a
# checkpoint written before they were recorded on the fields it has.
# num_moe_experts and moe_ffn_hidden_size (0 for a dense model) tell Qwen3-MoE from Qwen3 dense.
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                "kv_channels", "add_qkv_bias", "qk_layernorm", "vocab_size", "num_moe_experts", "moe_ffn_hidden_size")
MOE_SHAPE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size")  # megatron's TransformerConfig: None when dense


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def write_text(path: Path, text: str) -> None:
    """Write, flush and fsync (so that the later rename never publishes an empty file)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
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


def read_trainer_state(path: str | os.PathLike) -> dict:
    """The caller's dict saved with a checkpoint (plain JSON: readable before anything is built)."""
    return json.loads((Path(path) / TRAINER_STATE).read_text())


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


_SHAPE_FIX = "resume with the model it was trained with, or start a new logging.dir"


def check_model_shape(path: Path, meta: dict, shape: dict, *, fix: str = _SHAPE_FIX) -> None:
    """InputError naming both shapes when a checkpoint was saved from another architecture."""
    saved = meta.get("model_shape")
    if saved is not None and any(saved[k] != shape.get(k) for k in saved):  # the fields it recorded
        diff = ", ".join(f"{k} {saved.get(k)} -> {shape.get(k)}" for k in SHAPE_FIELDS
                         if k in saved and saved.get(k) != shape.get(k))
        raise InputError(f"checkpoint {path} holds another model shape ({diff}; checkpoint -> this run's "
                         f"model): {fix}")


def manifest(path: Path) -> dict[str, int]:
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


def checkpoint_of_step(root: str | os.PathLike, step: int, *, use: str) -> Path:
    """The intact checkpoint of ``step`` under ``root``; InputError naming the steps there are
    (``use``: what the caller would do with it, for the message)."""
    root = Path(root)
    path = root / checkpoint_name(step)
    if not path.is_dir():
        have = [s for s, _ in list_checkpoints(root)]
        raise InputError(f"{path}: no checkpoint of step {step} to {use}; {root} holds steps {have or 'none'}")
    if (why := damage(path)) is not None:
        raise InputError(f"checkpoint {path} is damaged ({why}); {use} another step")
    return path


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
            state = "incomplete" if (root / named).exists() else "missing"
            problems.append(f"{LATEST} names {named}, which is {state}")
    return "; ".join(problems) or None


def remove_leftovers(root: Path, suffixes: tuple[str, ...] = ("tmp", "old")) -> None:
    """Delete ``step_*.tmp`` / ``step_*.old`` directories: saves that crashed, or were written and
    never published. Only one process saves under a root (the run lock), so none is in use."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        stem, _, suffix = path.name.rpartition(".")
        if path.is_dir() and suffix in suffixes and _NAME.match(stem):
            shutil.rmtree(path, ignore_errors=True)


def publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished save into place, then point ``latest`` at it (write + rename)."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # re-saving a step: move the previous copy aside, drop it afterwards
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    pointer_tmp = root / (LATEST + ".tmp")
    write_text(pointer_tmp, final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    fsync_dir(root)
    if old.exists():
        shutil.rmtree(old)


def prune(root: Path, keep_last: int, keep: Path) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    remove_leftovers(root)
