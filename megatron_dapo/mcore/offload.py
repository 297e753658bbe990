"""The trainer's state off the device while the rollout engine generates (``actor.offload_during_rollout``).

What moves (docs/offload.md), per device storage and each storage once however many tensors view it:

* ``grads``: megatron DDP's gradient buffers (``_ParamAndGradBuffer.grad_data``: every parameter's
  ``main_grad``, the optimizer params' ``.grad`` and the distributed optimizer's shard views are views
  of it), plus any ``.grad`` / ``main_grad`` with a storage of its own.
* ``optimizer``: the torch optimizer's state (Adam ``exp_avg``, ``exp_avg_sq``; none before the first
  update) and its params when they are tensors of their own: the fp32 main params of bf16 training
  (``fp32_from_float16_groups`` / the distributed optimizer's ``shard_fp32_from_float16_groups``).
  In fp32 training the torch optimizer steps the weights themselves (or, with the distributed
  optimizer, views of DDP's ``param_data``): those are ``weights``, not optimizer state.
* ``weights`` (``weights=True`` only): the parameters' storages (DDP's ``param_data`` with the
  distributed optimizer, each parameter's own storage without it).

The mechanism is the same on CPU and GPU: copy a storage's bytes into host memory (pinned on CUDA),
then ``untyped_storage().resize_(0)``; back: ``resize_`` to the old size and copy the bytes in.
Every tensor object (parameters, DDP buckets and their views, ``main_grad``, the optimizer's state
and param groups) keeps pointing at the same storage object, so nothing needs re-wiring, and the
values come back bit for bit. Gradient buffers are released, not copied, unless ``keep_grads``:
train_step zeroes them before every update's backward, so between updates their values are dead;
they come back as zeros (what zero_grad_buffer leaves), which saves 4 bytes per parameter of host
memory and of PCIe traffic each way.

Host memory is a set of equal power-of-two slabs, filled back to back and kept between offloads:
torch's pinned-memory allocator rounds every allocation up to a power of two, so one buffer per
tensor (or one for all) could hold up to twice the bytes; slabs waste under one slab (256 MiB, or
an eighth of a small state) in all.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch

from megatron_dapo.mcore.step_settings import compute_device

logger = logging.getLogger(__name__)

GB = 1e9  # as memory_plan.py
SLAB_BYTES = 1 << 28  # 256 MiB: a power of two, so the pinned allocator adds nothing to it
_ALIGN = 512  # host offsets of each storage: aligned copies are the fast DMA path
KINDS = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class OffloadStats:
    """One offload() (or onload()): device bytes per kind, in bytes; zeros when there was nothing to do
    (already offloaded / already on the device)."""

    weight_bytes: int = 0  # parameter storages (weights=True), copied
    grad_bytes: int = 0  # gradient storages: released (copied only with keep_grads)
    optimizer_bytes: int = 0  # Adam moments and separate fp32 main params, copied
    copied_bytes: int = 0  # of the above, what went through host memory (the rest comes back as zeros)
    host_bytes: int = 0  # host memory held for the copies (whole slabs; kept between offloads)
    num_storages: int = 0
    seconds: float = 0.0

    @property
    def device_bytes(self) -> int:
        """Device bytes released by an offload (re-allocated by an onload)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def metrics(self) -> dict[str, float]:
        """For the step's record: the device GB (1e9 bytes) the offload released."""
        return {"actor/offloaded_gb": self.device_bytes / GB}


@dataclass
class _Moved:
    storage: torch.UntypedStorage  # the very storage object the tensors share (size 0 while offloaded)
    nbytes: int
    kind: str  # one of KINDS
    host_offset: int | None  # where its bytes are in the slabs; None: released only (zeros on the way back)


class StateOffloader:
    """Moves the state of megatron-DDP-wrapped ``model`` chunks and their megatron (or torch)
    ``optimizer`` to host memory and back, in place.

    ``offload()`` / ``onload()`` are idempotent and return what they moved. What to move is found at
    each offload (Adam's state appears at the first update; a checkpoint load may replace tensors),
    and nothing is referenced between an onload and the next offload. While offloaded the model
    must not run: a forward raises; any other use of a released tensor (an update, an export, a
    checkpoint save) would read freed memory, so callers onload first.

    ``weights``: the parameters too. ``keep_grads``: copy the gradient buffers instead of releasing
    them. ``slab_bytes``: size of the host slabs (a power of two; tests use small ones to cross slab
    boundaries). ``device``: where the state lives (default: the compute device).
    """

    def __init__(self, model: list, optimizer, *, weights: bool = False, keep_grads: bool = False,
                 slab_bytes: int = SLAB_BYTES, device: torch.device | None = None):
        if slab_bytes < _ALIGN or slab_bytes & (slab_bytes - 1):
            raise ValueError(f"slab_bytes must be a power of two >= {_ALIGN}, got {slab_bytes}")
        for chunk in model:
            # NCCL user buffers register the buffers' addresses; a re-allocated buffer would be a new one.
            if getattr(getattr(chunk, "ddp_config", None), "nccl_ub", False):
                raise ValueError("offloading does not support DDP's nccl_ub (registered buffer addresses)")
        self.model, self.optimizer = model, optimizer
        self.weights, self.keep_grads, self.slab_bytes = weights, keep_grads, slab_bytes
        self.device = torch.device(device) if device is not None else compute_device()
        self._pin = self.device.type == "cuda"
        self._moved: list[_Moved] = []
        self._slabs: list[torch.Tensor] = []  # uint8 [slab size] each, all the same size
        self._hooks: list = []
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @property
    def host_bytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    @property
    def host_pinned(self) -> bool:
        """Whether the host copies are in pinned (page-locked) memory: on CUDA, for DMA at full speed."""
        return bool(self._slabs) and all(s.is_pinned() for s in self._slabs)

    # -- what moves ---------------------------------------------------------------------------
    def storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """The device storages an offload now would move, by kind (KINDS), each storage once. While
        offloaded: the moved ones (size 0), as they were found."""
        if self._offloaded:
            return {k: [m.storage for m in self._moved if m.kind == k] for k in KINDS}
        seen: set[int] = set()
        found: dict[str, list[torch.UntypedStorage]] = {k: [] for k in KINDS}

        def add(kind: str, t) -> None:
            if not isinstance(t, torch.Tensor):
                return
            s = t.untyped_storage()
            # data_ptr identifies a live allocation (two storages never share one); an empty storage
            # (already released, or a 0-element tensor) has nothing to move.
            if s.device != self.device or s.nbytes() == 0 or s.data_ptr() in seen:
                return
            seen.add(s.data_ptr())
            found[kind].append(s)

        params = [p for chunk in self.model for p in chunk.parameters()]
        buffers = [b for chunk in self.model for b in _ddp_buffers(chunk)]
        # Weights first, even when they stay: a tensor that shares a weight's storage (fp32 training's
        # optimizer params) is a weight, never optimizer state.
        for b in buffers:
            add("weights", b.param_data)
        for p in params:
            add("weights", p)
        for b in buffers:
            add("grads", b.grad_data)
            for g in getattr(b, "extra_main_grads", None) or []:
                add("grads", g)
        for p in params:
            add("grads", getattr(p, "main_grad", None))
            add("grads", p.grad)
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    add("optimizer", p)
                    # fp32 + distributed optimizer: the params are non-leaf views, whose .grad torch warns
                    # about reading.
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        add("grads", p.grad)
            for state in opt.state.values():
                for v in state.values():
                    # Scalars stay: Adam's step (torch keeps it on the host unless capturable), bytes.
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        add("optimizer", v)
        if not self.weights:
            found["weights"] = []
        return found

    # -- moving -------------------------------------------------------------------------------
    def offload(self) -> OffloadStats:
        """Copy to host, then release the device storages. No-op (zero stats) when already offloaded."""
        if self._offloaded:
            return OffloadStats()
        start = time.perf_counter()
        moved, end = [], 0
        for kind, storages in self.storages().items():
            for s in storages:
                if not s.resizable():  # e.g. memory-mapped from a file: cannot be released in place
                    logger.warning("offload: a %s storage of %d bytes is not resizable; it stays on the "
                                   "device", kind, s.nbytes())
                    continue
                copy = kind != "grads" or self.keep_grads
                moved.append(_Moved(s, s.nbytes(), kind, end if copy else None))
                if copy:
                    end = -(-(end + s.nbytes()) // _ALIGN) * _ALIGN
        self._reserve_host(end)
        for m in moved:
            if m.host_offset is not None:
                device_bytes = _bytes_of(m.storage)
                for host, src in self._spans(m):
                    host.copy_(device_bytes[src], non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize(self.device)  # every copy landed before its source is released
        for m in moved:
            m.storage.resize_(0)
        if self._pin:
            torch.cuda.empty_cache()  # back to the driver: the engine allocates outside torch's cache
        self._moved, self._offloaded = moved, True
        self._hooks = [chunk.register_forward_pre_hook(_refuse_forward) for chunk in self.model]
        return self._stats(moved, time.perf_counter() - start)

    def onload(self) -> OffloadStats:
        """Re-allocate every released storage and copy its bytes back (released gradients: zeros).
        No-op (zero stats) when nothing is offloaded."""
        if not self._offloaded:
            return OffloadStats()
        start = time.perf_counter()
        moved = self._moved
        for m in moved:
            m.storage.resize_(m.nbytes)
            device_bytes = _bytes_of(m.storage)
            if m.host_offset is None:
                device_bytes.zero_()
            else:
                for host, src in self._spans(m):
                    device_bytes[src].copy_(host, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize(self.device)  # the next offload may overwrite the slabs
        for hook in self._hooks:
            hook.remove()
        # Hold no reference until the next offload: a checkpoint load may replace tensors, and a
        # stale reference would keep the old ones' memory.
        self._moved, self._hooks, self._offloaded = [], [], False
        return self._stats(moved, time.perf_counter() - start)

    # -- host memory --------------------------------------------------------------------------
    def _reserve_host(self, total: int) -> None:
        """ceil(total / size) slabs of ``size`` bytes: slab_bytes, or for a small state a 16th of the
        next power of two at or above ``total`` (so under total / 8 wasted); under one slab wasted either
        way. Kept while the size stays (from the first update on, the state's size does not change), so
        the pinned allocation (slow: seconds for tens of GB) is paid once."""
        size = min(self.slab_bytes, max(_ALIGN, _next_pow2(max(total, 1)) >> 4))
        count = -(-total // size)
        if self._slabs and self._slabs[0].numel() != size:
            self._slabs = []
        del self._slabs[count:]
        while len(self._slabs) < count:
            self._slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self._pin))

    def _spans(self, m: _Moved) -> Iterator[tuple[torch.Tensor, slice]]:
        """(slab part, slice of the storage's bytes) pairs that together hold the storage."""
        size = self._slabs[0].numel()
        done = 0
        while done < m.nbytes:
            index, at = divmod(m.host_offset + done, size)
            n = min(size - at, m.nbytes - done)
            yield self._slabs[index][at:at + n], slice(done, done + n)
            done += n

    def _stats(self, moved: list[_Moved], seconds: float) -> OffloadStats:
        per = {k: sum(m.nbytes for m in moved if m.kind == k) for k in KINDS}
        copied = sum(m.nbytes for m in moved if m.host_offset is not None)
        return OffloadStats(weight_bytes=per["weights"], grad_bytes=per["grads"],
                            optimizer_bytes=per["optimizer"], copied_bytes=copied, host_bytes=self.host_bytes,
                            num_storages=len(moved), seconds=seconds)


def _ddp_buffers(chunk) -> list:
    """Megatron DDP's param-and-grad buffers of a chunk (dense and expert-parallel); [] for anything else
    (its ``buffers`` is then nn.Module's method, which megatron DDP shadows with a list)."""
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, list):
            out.extend(value)
    return out


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (ChainedOptimizer -> MegatronOptimizer -> torch), or a
    torch optimizer itself. A stub optimizer (no params on this rank) has none."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 [nbytes] tensor over the whole storage (whatever dtypes its tensors view it as)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _refuse_forward(module, args):
    raise RuntimeError("the trainer's state is offloaded (actor.offload_during_rollout): call "
                       "onload_after_rollout() before running the model")
