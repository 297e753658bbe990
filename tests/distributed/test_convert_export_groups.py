"""Live export over real gloo TP / PP groups, on stand-in chunks (no megatron import, seconds per case).

Rank layout as Megatron's default order (tp fastest): rank = pp_rank * tp + tp_rank. Each rank holds
its TP shard of its stage's layers; every rank must get every full HF tensor back.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.convert import conversion_table, hf_to_megatron_state_dict, split_tp
from megatron_dapo.convert.export import export_hf_weights

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, tp: int, tied: bool, port: int):
    from tests.helpers.convert import TINY, stand_in_chunk

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pp = world // tp
    tp_groups = [dist.new_group([p * tp + t for t in range(tp)]) for p in range(pp)]
    pp_groups = [dist.new_group([p * tp + t for p in range(pp)]) for t in range(tp)]
    pp_rank, tp_rank = divmod(rank, tp)
    config = {**TINY, "num_hidden_layers": 4, "tie_word_embeddings": tied}
    table = conversion_table(config, padded_vocab_size=112)
    gen = torch.Generator().manual_seed(0)  # same random weights on every rank
    sd = {n: torch.randn(s, generator=gen)
          for t in table.tasks for n, s in zip(t.hf_names, t.mapping.hf_shapes(table.dims))}
    shard = split_tp(table, hf_to_megatron_state_dict(table, sd), tp)[tp_rank]
    per_stage = 4 // pp
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    keep = {k: v for k, v in shard.items()
            if (k.startswith("embedding") and pp_rank == 0)
            or (k.startswith(("decoder.final", "output")) and pp_rank == pp - 1)
            or k.startswith("decoder.layers")}
    chunk = stand_in_chunk(keep, layers)
    out = dict(export_hf_weights([chunk], table, tp_group=tp_groups[pp_rank], pp_group=pp_groups[tp_rank],
                                 bucket_bytes=4096))
    assert list(out) == table.hf_names()
    bad = [k for k, v in sd.items() if not torch.equal(out[k], v)]
    assert not bad, f"rank {rank}: {bad}"
    dist.destroy_process_group()


@pytest.mark.parametrize("world,tp,tied", [(2, 2, False), pytest.param(2, 1, True, marks=pytest.mark.slow),
                                           pytest.param(4, 2, False, marks=pytest.mark.slow)])
def test_export_over_tp_pp_groups_gives_every_rank_the_full_tensors(world, tp, tied):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, tp, tied, _free_port()), nprocs=world, join=True)
