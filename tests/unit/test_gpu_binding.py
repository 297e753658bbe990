"""One GPU a rank (gpu_binding.py): the launch that puts more processes on a node than it shows GPUs,
and the one whose ranks see one GPU under different indices, each refused in one line before any
process group starts. The store exchange runs over a real torch store, the ranks as threads; the
GPU identities are given (the H200 run in docs/gpu.md made them from a real GPU)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.gpu_binding import bind_gpu, check_distinct_gpus, first_shared_gpu


def test_the_first_two_ranks_holding_one_gpu_are_named():
    assert first_shared_gpu(["h GPU a", "h GPU b", "g GPU a"]) is None  # one UUID on two hosts: two GPUs
    assert first_shared_gpu(["h GPU a", "h GPU b", "h GPU c", "h GPU b", "h GPU a"]) == (1, 3, "h GPU b")
    assert first_shared_gpu([]) is None


def _launch(identities: list[str], restart: str | None = None, store=None) -> list[str | None]:
    """Every rank's check_distinct_gpus over one store, concurrently: each rank's error (None: passed)."""
    store = store if store is not None else dist.HashStore()

    def rank(r: int) -> str | None:
        try:
            check_distinct_gpus(store, r, len(identities), identities[r])
        except ConfigError as error:
            return str(error)
        return None

    with ThreadPoolExecutor(len(identities)) as pool:
        return list(pool.map(rank, range(len(identities))))


def test_a_launch_whose_ranks_share_a_gpu_is_refused_on_every_rank():
    assert _launch(["n1 GPU a", "n1 GPU b", "n2 GPU a", "n2 GPU b"]) == [None] * 4
    errors = _launch(["n1 GPU a", "n1 GPU b", "n1 GPU a"])
    assert errors == [errors[0]] * 3 and "ranks 0 and 2 of this launch hold the same GPU (n1 GPU a)" in errors[0]
    assert "\n" not in errors[0] and "a GPU of its own for each rank" in errors[0]


def test_a_restarted_launch_does_not_read_its_previous_attempts_identities(monkeypatch):
    """torchrun's agent store outlives a restart of its workers: the keys carry the restart count."""
    store = dist.HashStore()
    assert _launch(["h GPU a", "h GPU b"], store=store) == [None, None]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert all(e and "ranks 0 and 1" in e for e in _launch(["h GPU c", "h GPU c"], store=store))


def test_a_local_rank_without_a_gpu_of_its_own_is_one_line_with_the_fix(monkeypatch):
    """torchrun --nproc-per-node=2 on a node that shows one GPU: the second process. The GPU count is
    given (this machine has none); the GPU run in docs/gpu.md launched it for real."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as error:
        bind_gpu()
    message = str(error.value)
    assert message == ("LOCAL_RANK=1, but this process sees 1 GPU (CUDA_VISIBLE_DEVICES=3): NCCL needs a GPU of "
                       "its own for each rank; start at most 1 process a node (torchrun --nproc-per-node=1)")
