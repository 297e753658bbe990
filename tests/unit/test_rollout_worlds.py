"""Separate placement's pure parts: a bucket's framing for the weight stream (rollout/weight_stream.py),
and the splits rollout/worlds.py refuses. The 4-process stream itself: tests/distributed/test_separate_worlds.py."""

import pytest
import torch

from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout.weight_stream import pack, unpack
from megatron_dapo.rollout.worlds import check_split


def test_a_bucket_of_mixed_dtypes_round_trips_bit_for_bit():
    """An odd-sized bf16 tensor puts the fp32 one after it off its 4-byte alignment: unpack copies
    that piece, views the rest."""
    g = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, generator=g).to(torch.bfloat16)), ("b", torch.randn(2, 5, generator=g)),
              ("c", torch.randint(0, 9, (4,), generator=g)), ("empty", torch.zeros(0, 3)),
              ("d", torch.randn(2, 3, generator=g).to(torch.float16).t())]  # not contiguous
    header, flat = pack(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == 3 * 2 + 10 * 4 + 4 * 8 + 0 + 6 * 2
    got = unpack(header, flat.clone())
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, want), (_, t) in zip(bucket, got):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    assert unpack(*pack([])) == []


@pytest.mark.parametrize("world,engines,tp,fix", [(4, 4, 1, "give the engines 1 to 3"), (4, 0, 1, "1 to 3"),
                                                  (6, 3, 2, "not a multiple of rollout.tensor_parallel_size=2"),
                                                  (1, 1, 1, "needs at least 2 ranks")])
def test_a_split_that_cannot_run_is_refused(world, engines, tp, fix):
    with pytest.raises(ConfigError, match=fix):
        check_split(world, engines, tp)
    assert check_split(4, 2, 2) == 2


@pytest.mark.parametrize("overrides,fix", [(["rollout.placement=nearby"], "colocated or separate"),
                                           (["rollout.placement=separate"], "needs the engines' ranks"),
                                           (["rollout.num_ranks=2"], "colocated none"),
                                           (["rollout.placement=separate", "rollout.num_ranks=-1"], "needs"),
                                           (["rollout.max_staleness=1"], "use rollout.placement=separate")])
def test_placement_settings_are_checked_with_the_config(overrides, fix):
    from megatron_dapo.config_loading import load_config

    with pytest.raises(ConfigError, match=fix):
        load_config(None, overrides)
