"""One GPU a rank (gpu_binding.py): a launch that puts more processes on a node than it shows GPUs,
or whose ranks see one GPU under different indices, is refused in the same line on every rank
before NCCL's first collective. The exchange runs as separate placement's split runs it (a gloo
group over the rendezvous store, rollout/channel.gather_objects), the ranks as threads; the
bindings are given (the H200 run in docs/gpu.md made them from a real GPU)."""

import datetime
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron_dapo.errors import ConfigError
from megatron_dapo.gpu_binding import Binding, bind_gpu, check_bindings, first_shared_gpu
from megatron_dapo.rollout.channel import gather_objects


def test_the_first_two_ranks_holding_one_gpu_are_named():
    assert first_shared_gpu(["a", "b", "c"]) is None
    assert first_shared_gpu(["a", None, "b", None, "c", "b", "a"]) == (2, 5)  # None: a refused rank
    assert first_shared_gpu([]) is None


def _launch(bindings: list[Binding]) -> list[str | None]:
    """Every rank gathers every binding over one gloo group and checks them: each rank's error
    (None: it passed)."""
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=60)

    def rank(r: int) -> str | None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("gpu_binding/", store), r, len(bindings), timeout)
        gathered = gather_objects(group, len(bindings), torch.device("cpu"), bindings[r])
        assert gathered == bindings
        try:
            check_bindings(gathered)
        except ConfigError as error:
            return str(error)
        return None

    with ThreadPoolExecutor(len(bindings)) as pool:
        return list(pool.map(rank, range(len(bindings))))


def test_a_launch_whose_ranks_share_a_gpu_is_refused_on_every_rank():
    own = [Binding("n1", gpu="GPU-a"), Binding("n1", gpu="GPU-b"), Binding("n2", gpu="GPU-c")]
    assert _launch(own) == [None] * 3
    errors = _launch([Binding("n1", gpu="GPU-a"), Binding("n1", gpu="GPU-b"), Binding("n1", gpu="GPU-a")])
    assert errors == [errors[0]] * 3, errors
    assert errors[0].startswith("ranks 0 and 2 of this launch hold the same GPU (GPU GPU-a on n1): NCCL needs a GPU "
                                "of its own for each rank")


def test_a_rank_without_a_gpu_is_named_on_every_rank():
    """Not only on the rank that has none: the others would wait for it until the launcher kills them."""
    errors = _launch([Binding("n1", gpu="GPU-a"), Binding("n1", refusal="LOCAL_RANK=1, but ...")])
    assert errors == ["rank 1: LOCAL_RANK=1, but ..."] * 2


def test_a_local_rank_without_a_gpu_of_its_own_is_refused_with_the_fix(monkeypatch):
    """torchrun --nproc-per-node=2 on a node that shows one GPU: the second process. The GPU count is
    given (this machine has none); the H200 run in docs/gpu.md launched it for real."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    binding = bind_gpu()
    assert binding.gpu is None and binding.refusal == (
        f"LOCAL_RANK=1, but this process sees 1 GPU (CUDA_VISIBLE_DEVICES=3) on {binding.host}: NCCL needs a GPU of "
        "its own for each rank; start at most 1 process a node (torchrun --nproc-per-node=1)")
