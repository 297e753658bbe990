"""The rules by which a launch's machine decides the settings left at "auto": the training dtype (shared
by the trainer, mcore/model.py, and the rollout engine, rollout/vllm_translation.py), the layer spec and
the MoE token dispatcher. A leaf module, so the engine does not import the config schema."""

from typing import Literal


def resolve_dtype(dtype: str, on_gpu: bool) -> Literal["bf16", "fp32"]:
    """model.dtype with "auto" resolved: bf16 on GPU, fp32 on CPU (the trainer's and the rollout
    engine's dtype alike)."""
    if dtype == "auto":
        return "bf16" if on_gpu else "fp32"
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"model.dtype must be auto, bf16 or fp32, got {dtype!r}")
    return dtype


def resolve_transformer_impl(impl: str, on_gpu: bool) -> str:
    """model.transformer_impl with "auto" resolved: Transformer Engine's spec on GPU, the local spec on CPU."""
    if impl == "auto":
        return "transformer_engine" if on_gpu else "local"
    return impl


def resolve_token_dispatcher(dispatcher: str, on_gpu: bool) -> str:
    """moe.token_dispatcher with "auto" resolved: alltoall on GPU, allgather on CPU (where alltoall runs too,
    through cpu_compat's shims; the CPU's MoE demo, tests and measurements were made with allgather)."""
    if dispatcher == "auto":
        return "alltoall" if on_gpu else "allgather"
    return dispatcher
