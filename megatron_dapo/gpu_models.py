"""The GPUs the memory plan knows, and the per-process device memory no framework accounts for.

Each number's source is in docs/memory_plan.md ("Constants"); the comments here say why the plan
needs it. Pure data: no torch, no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GPUModel:
    """One GPU model as the plan sees it.

    reported_bytes: the total that cudaMemGetInfo (torch.cuda.mem_get_info) reports, in bytes. It is
        less than the marketed size and less than nvidia-smi's memory.total (the driver reserves some),
        and it is what rollout.gpu_memory_utilization is a fraction of (vLLM's request_memory).
    hbm_bytes_per_s: peak HBM bandwidth (bytes/s), for the decode model.
    bf16_flops: dense bf16 tensor-core peak (FLOP/s), for the FLOPs model.
    gpus_per_node: GPUs in one node of the usual (HGX) server, for per-node host memory.
    """

    key: str
    name: str
    marketed_gb: int
    reported_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    gpus_per_node: int = 8

    def with_capacity(self, gb: float | None) -> "GPUModel":
        """This model with its reported total replaced by ``gb`` x 1e9 bytes (--gpu-memory-gb): the
        override wins over the table; bandwidth and FLOPs stay the model's."""
        if gb is None:
            return self
        return GPUModel(self.key, f"{self.name}, {gb:g} GB given", self.marketed_gb, int(gb * 1e9),
                        self.hbm_bytes_per_s, self.bf16_flops, self.gpus_per_node)


GPU_MODELS: dict[str, GPUModel] = {
    # 79.22 GiB: vLLM's own start-up log on an H100 80GB (vllm-project/vllm#12126)
    "h100": GPUModel("h100", "H100 80GB HBM3 (SXM)", 80, round(79.22 * GiB), 3.35e12, 989e12),
    # 139.80 GiB: PyTorch's "total capacity" on H200s (public out-of-memory logs; docs/memory_plan.md)
    "h200": GPUModel("h200", "H200 141GB HBM3e (SXM)", 141, round(139.80 * GiB), 4.8e12, 989e12),
}

# One CUDA context per GPU: vLLM runs in the trainer's process when colocated
# (VLLM_ENABLE_V1_MULTIPROCESSING=0), so trainer and engine share it. Source: pytorch/pytorch#107667.
CUDA_CONTEXT_BYTES = 300 * MiB

# GPU memory one NCCL communicator holds once it has run a collective: buffers per channel and
# peer, which no allocator reports and no framework counts. Groups of two ranks connect fewer peers.
# Source: NVIDIA/nccl#964 (docs/memory_plan.md has the cross-checks and what lowers it).
NCCL_COMM_BYTES_TWO_RANKS = 544 * MiB
NCCL_COMM_BYTES = 688 * MiB


def nccl_comm_bytes(ranks: int) -> float:
    """Device bytes of one communicator over ``ranks`` ranks (0 for a group of one: no NCCL)."""
    if ranks <= 1:
        return 0.0
    return float(NCCL_COMM_BYTES_TWO_RANKS if ranks == 2 else NCCL_COMM_BYTES)


def gpu_model(key: str) -> GPUModel:
    """The table's entry for ``key`` (h100, h200); ValueError naming the known ones otherwise."""
    try:
        return GPU_MODELS[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(GPU_MODELS)}") from None
