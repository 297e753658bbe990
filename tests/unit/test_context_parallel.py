"""The context-parallel layout (mcore/context_parallel.py) against megatron's own: each CP rank holds the
positions megatron-core 0.19.2's ``get_batch_on_this_cp_rank`` gives it (the layout its RoPE follows),
and the gather puts every rank's share back in order; a packed row's segments are cut one by one, as
megatron's THD RoPE reads them. The distributed halves (attention over the gathered keys, the loss
and gradients at CP 2 with TP, PP and DP) are tests/distributed/test_policy_cp.py."""

import pytest
import torch

from megatron_dapo.mcore.context_parallel import cp_chunks, positions_on_rank, restore_order, slice_for_rank


def _megatron_share(batch: dict, cp_size: int, cp_rank: int, monkeypatch) -> dict:
    """megatron's split of ``batch`` for one CP rank, its group's size and rank answered here."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp_size)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: cp_rank)
    return get_batch_on_this_cp_rank(dict(batch, cu_seqlens=None), is_hybrid_cp=False, cp_group=object())


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_each_rank_holds_the_positions_megatron_gives_it(cp_size, monkeypatch):
    seq = 8 * cp_size
    ids = torch.arange(3 * seq).view(3, seq)  # every position's value is its own: order mistakes show
    for rank in range(cp_size):
        want = _megatron_share({"tokens": ids}, cp_size, rank, monkeypatch)["tokens"]
        assert torch.equal(slice_for_rank(ids, cp_size, rank), want), rank
        assert torch.equal(positions_on_rank(seq, cp_size, rank), want[0])


@pytest.mark.parametrize("cp_size", [2, 3])
def test_a_packed_rows_segments_are_cut_one_by_one_as_megatrons_thd_rope_reads_them(cp_size):
    """A packed row (THD): each segment (a sample's slot, cu_seqlens) gives this rank its own two chunks,
    segment after segment: the positions megatron's RoPE gives a rank's tokens of each sequence under CP
    (rope_utils._get_thd_freqs_on_this_cp_rank, reading a whole-row position table at the segment's
    offset)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    unit = 2 * cp_size
    bounds = (0, 3 * unit, 4 * unit, 7 * unit, 9 * unit)
    total = bounds[-1]
    table = torch.arange(total)  # position j's "frequency" is j
    for rank in range(cp_size):
        want = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp_size, torch.empty((end - start) // cp_size),
                                                        table, start)
                          for start, end in zip(bounds[:-1], bounds[1:])])
        assert torch.equal(positions_on_rank(total, cp_size, rank, bounds), want), rank
    values = torch.randn(2, total, 3)
    shares = [slice_for_rank(values, cp_size, r, bounds=bounds) for r in range(cp_size)]
    assert torch.equal(restore_order(shares, dim=1, bounds=bounds), values)
    with pytest.raises(ValueError, match="does not split into 2 x CP"):
        positions_on_rank(total, cp_size, 0, (0, unit + 1, total))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_the_shares_of_every_rank_put_back_in_order_are_the_row(cp_size):
    values = torch.randn(2, 16, 3)  # [b, s, d]: the sequence along dim 1
    shares = [slice_for_rank(values, cp_size, r) for r in range(cp_size)]
    assert sum(s.shape[1] for s in shares) == 16
    assert torch.equal(restore_order(shares, dim=1), values)
    # a different dim: keys laid out [b, heads, s, d]
    keys = values.transpose(1, 2).contiguous()
    assert torch.equal(restore_order([slice_for_rank(keys, cp_size, r, dim=2) for r in range(cp_size)], dim=2), keys)


def test_load_balance_pairs_an_early_chunk_with_a_late_one():
    assert [cp_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="cp_rank=2 outside a CP group of 2"):
        cp_chunks(2, 2)


def test_a_row_that_does_not_split_into_2_cp_chunks_is_refused():
    with pytest.raises(ValueError, match="a sequence of 10 positions does not split into 2 x CP = 4 chunks"):
        positions_on_rank(10, 2, 0)
