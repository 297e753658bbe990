"""The engine's start-up memory check sees the device as vLLM does (vllm_engine.device_memory).

vLLM empties torch's allocator cache before it measures free memory; a check that reads
cudaMemGetInfo while torch still caches the trainer's freed blocks would refuse memory that vLLM
then gets. The device is named: a thread of its own starts on GPU 0 whatever device the process
bound (CUDA's current device is per thread), and an engine built in an engine rank's worker thread
measured GPU 0 before it bound its own. Skipped without CUDA (tests/conftest.py).
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
    free, total = device_memory(torch.device("cuda", torch.cuda.current_device()))
    assert abs(free - before) < (64 << 20) and total > free


def test_a_worker_thread_binds_its_rank_s_gpu_and_reads_memory_of_that_gpu():
    """The engine worker (rollout/engine_server.py) binds split.device first; here the last GPU of
    the machine (the same as GPU 0 on a one-GPU machine, so the bind shows only with two or more)."""
    from megatron_dapo.rollout.engine_server import Worker
    from megatron_dapo.rollout.protocol import Stop
    from megatron_dapo.rollout.worlds import WorldSplit

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    seen = {}

    class Probe(Worker):
        def run(self):
            seen["fresh thread"] = torch.cuda.current_device()
            super().run()  # binds, then ends at the Stop
            seen["bound"] = torch.cuda.current_device()

    worker = Probe(WorldSplit(is_trainer=False, rank=1, world_size=2, num_trainers=1, num_engines=1, device=last))
    worker.work.put(Stop())
    worker.start()
    worker.join(timeout=60)
    assert worker.error is None and seen == {"fresh thread": 0, "bound": last.index}, seen
    free, total = device_memory(last)
    assert 0 < free <= total == torch.cuda.get_device_properties(last).total_memory
