"""The vLLM engine's checks before it builds anything (no vllm import): the device memory its
start-up rule will ask for, and what vLLM's CPU build supports. Re-exported by vllm_engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_dapo.errors import ConfigError

# vllm/v1/attention/backends/cpu_attn.py CPUAttentionBackend.get_supported_head_sizes() in 0.32.0
# (a unit test checks this copy against the installed vLLM).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_device_memory(fraction: float, free_bytes: int, total_bytes: int) -> None:
    """vLLM's start-up rule on CUDA: the engine may take ``fraction`` of the device's total memory,
    and that much must be free when it is built (the trainer's memory counts against it)."""
    want = fraction * total_bytes
    if free_bytes < want:
        gib = 1 << 30
        raise ConfigError(
            f"rollout.gpu_memory_utilization={fraction} asks for {want / gib:.2f} GiB of the device's "
            f"{total_bytes / gib:.2f} GiB, but only {free_bytes / gib:.2f} GiB is free now: lower it to "
            f"<= {free_bytes / total_bytes:.2f}, or set rollout.kv_cache_memory_mb")


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device`` as vLLM's start-up check sees them: vLLM empties torch's
    allocator cache before it measures (v1/worker/gpu_worker.py), so blocks the trainer freed but
    torch still caches count as free; without emptying, the check here would refuse memory vLLM
    then gets. The device is named, never taken as the current one: that is per thread, and a
    thread starts on GPU 0 (an engine built in a worker thread measured GPU 0)."""
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def check_cpu_kv_cache(kv_cache_memory_bytes: int | None) -> None:
    """On CPU the KV cache must be sized explicitly (rollout.kv_cache_memory_mb)."""
    if kv_cache_memory_bytes is None:
        raise ConfigError(
            "vLLM on CPU needs an explicit KV-cache size: set rollout.kv_cache_memory_mb (e.g. 64 for the "
            "toy, as in conf/cpu_tiny_vllm.yaml; VLLMEngine(kv_cache_memory_bytes=...)): vLLM's CPU build "
            "counts this whole process, trainer included, against rollout.gpu_memory_utilization")


def check_cpu_head_dim(head_dim: int, model_path: str) -> None:
    if head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"{model_path}: head_dim {head_dim} is not supported by vLLM's CPU attention "
                         f"(supported: {list(CPU_HEAD_SIZES)}); use a model with one of those head sizes "
                         "(hidden_size / num_attention_heads), or rollout.engine=hf")


def check_cpu_moe_sync(model_path: str) -> None:
    """A training run's engine takes in-place weight syncs. vLLM's CPU build packs an MoE model's experts
    for its kernels once, after loading (fused_moe/experts/cpu_moe.py, ``cpu_prepack_moe_weight``): its
    logits then equal transformers' (1e-6 on a tiny Qwen3-MoE), but after an in-place sync its rollouts'
    log-probs were 0.043 off the synced model's, the experts left at a mix of the weights
    (tests/unit/test_rollout_vllm_qwen3_moe.py). Refused on CPU, before the engine is built; a directory
    without config.json is left to the engine's own message."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return
    from megatron_dapo.plan_params import experts  # the model's routed experts, by its architecture

    if experts(json.loads(config.read_text())):
        raise ConfigError(f"{model_path}: rollout.engine=vllm on CPU cannot train an MoE model: vLLM's CPU build "
                          "packs the experts once at load and an in-place weight sync does not reach them (its "
                          "rollouts would come from stale experts); use rollout.engine=hf on CPU")
