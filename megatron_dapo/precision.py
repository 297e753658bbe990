"""The one home of the training dtype rule, shared by the trainer (mcore/model.py) and the rollout
engine (rollout/vllm_translation.py); a leaf module, so the engine does not import the config schema."""

from typing import Literal


def resolve_dtype(dtype: str, on_gpu: bool) -> Literal["bf16", "fp32"]:
    """model.dtype with "auto" resolved: bf16 on GPU, fp32 on CPU (the trainer's and the rollout
    engine's dtype alike)."""
    if dtype == "auto":
        return "bf16" if on_gpu else "fp32"
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"model.dtype must be auto, bf16 or fp32, got {dtype!r}")
    return dtype
