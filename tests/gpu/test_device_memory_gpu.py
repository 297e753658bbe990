"""The engine's start-up memory check sees the device as vLLM does (vllm_engine.device_memory).

vLLM empties torch's allocator cache before it measures free memory; a check that reads
cudaMemGetInfo while torch still caches the trainer's freed blocks would refuse memory that vLLM
then gets. Skipped without CUDA (tests/conftest.py).
"""

import pytest
import torch

from megatron_dapo.rollout.vllm_engine import device_memory

pytestmark = pytest.mark.gpu


def test_cached_blocks_count_as_free():
    torch.cuda.empty_cache()
    before, _ = torch.cuda.mem_get_info()
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, then freed into torch's cache
    del block
    cached, _ = torch.cuda.mem_get_info()
    assert before - cached >= (1 << 30) * 0.9  # the reading the old check made: the block still "used"
    free, total = device_memory()
    assert abs(free - before) < (64 << 20) and total > free
