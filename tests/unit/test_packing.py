"""Packed micro-batches (batching.py, ``packed=True``): samples end to end in one row, each sample's
values at the same offsets within it as in its padded row, positions restarting per sample, no
label reaching into the next sample, the boundaries for attention, and the plan within the budget."""

import pytest
import torch

from megatron_dapo.batching import (
    Sample, build_micro_batch, make_micro_batches, padding_mask, plan_packs, response_mask, unpack_responses,
)


def _samples(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        out.append(Sample(prompt_ids=torch.randint(1, 50, (p,), generator=g),
                          response_ids=torch.randint(1, 50, (r,), generator=g),
                          advantages=float(i) - 1.5, old_log_probs=-torch.rand(r, generator=g),
                          rollout_log_probs=-torch.rand(r, generator=g),
                          loss_mask=(torch.arange(r) < r - 1).float() if i == 1 else None,
                          is_weights=torch.rand(r, generator=g) + 0.5,
                          routed_experts=torch.randint(0, 8, (p + r - 1, 4), generator=g)))
    return out


SHAPES = [(3, 5), (2, 7), (4, 1), (1, 6)]


def test_each_sample_holds_its_padded_rows_values_at_its_offset():
    xs = _samples(SHAPES)
    mb = build_micro_batch(xs, [0, 1, 2, 3], multiple=8, packed=True)
    lengths = [p + r for p, r in SHAPES]
    assert mb.input_ids.shape == (1, 32) and mb.starts == (0, 8, 17, 22)  # 28 tokens, 8 | 32
    assert mb.cu_seqlens().tolist() == [0, 8, 17, 22, 29, 32]  # the padding is a segment of its own
    for k, (x, start, length) in enumerate(zip(xs, mb.starts, lengths)):
        alone = build_micro_batch(xs, [k])  # its own padded row, independently built
        piece = slice(start, start + length)
        for name in ("input_ids", "labels", "loss_mask", "old_log_probs", "rollout_log_probs", "advantages",
                     "is_weights", "routed_experts"):
            assert torch.equal(getattr(mb, name)[0, piece], getattr(alone, name)[0, :length]), (k, name)
        assert mb.position_ids[0, piece].tolist() == list(range(length))  # positions restart
        assert mb.labels[0, start + length - 1] == 0  # the next sample is not this one's continuation
        assert torch.equal(response_mask(mb)[0, piece], response_mask(alone)[0, :length])
    assert mb.position_ids[0, 29:].tolist() == [0, 1, 2]
    assert padding_mask(mb)[0].tolist() == [False] * 29 + [True] * 3
    assert (mb.loss_mask[0, 29:] == 0).all() and (mb.routed_experts[0, 29:] == -1).all()


def test_under_context_parallelism_each_sample_gets_a_slot_of_whole_chunks():
    """segment_multiple = 2 x CP: each sample's slot is its length rounded up to it, its padding inside its
    own segment (cu_seqlens are the slots), so every segment cuts into 2 x CP equal chunks; the sample's
    values sit where they would without the rounding, relative to its start."""
    xs = _samples(SHAPES)
    mb = build_micro_batch(xs, [0, 1, 2, 3], multiple=8, packed=True, segment_multiple=4)
    assert mb.starts == (0, 8, 20, 28) and mb.input_ids.shape == (1, 40)  # slots 8, 12, 8, 8
    assert mb.cu_seqlens().tolist() == [0, 8, 20, 28, 36, 40]
    assert all(b % 4 == 0 for b in mb.cu_seqlens().tolist())
    plain = build_micro_batch(xs, [0, 1, 2, 3], multiple=8, packed=True)
    for start, plain_start, (p, r) in zip(mb.starts, plain.starts, SHAPES):
        for name in ("input_ids", "labels", "loss_mask", "advantages", "position_ids"):
            got = getattr(mb, name)[0, start:start + p + r]
            assert torch.equal(got, getattr(plain, name)[0, plain_start:plain_start + p + r]), name
    assert padding_mask(mb)[0, 17:20].all() and not padding_mask(mb)[0, 20:25].any()  # sample 1's slot padding
    # the plan costs each sample its slot: 12 + 8 and 8 + 8 under a budget of 24 (by their lengths alone,
    # 9 + 8 + 7 would share one pack)
    packs = make_micro_batches(xs, max_tokens=24, micro_batch_size=1, multiple=4, packed=True, segment_multiple=4)
    assert [m.sample_index for m in packs] == [(0, 1), (2, 3)]


def test_responses_unpack_and_gather_into_sequence_rows():
    xs = _samples(SHAPES)
    mb = build_micro_batch(xs, [2, 0, 3], packed=True)
    values = torch.arange(mb.input_ids.numel(), dtype=torch.float32).view(1, -1)
    padded = build_micro_batch(xs, [1])  # the two layouts unpack side by side
    got = unpack_responses([values, torch.arange(9.0).view(1, 9)], [mb, padded], len(xs))
    assert got[1].tolist() == list(range(1, 8))  # P 2, R 7
    for k, start in zip([2, 0, 3], mb.starts):
        p, r = SHAPES[k]
        assert got[k].tolist() == list(range(start + p - 1, start + p - 1 + r))
    index = mb.response_index()
    assert index.shape == (3, 6)
    assert index[0].tolist() == [3, -1, -1, -1, -1, -1]  # sample 2: P 4, R 1
    assert index[2].tolist() == [mb.starts[2] + 0 + c for c in range(6)]  # sample 3: P 1, R 6


def test_packs_fill_the_budget_first_fit_decreasing():
    lengths = [27, 20, 19, 16, 15, 12, 9, 8]
    plan = plan_packs(lengths, max_tokens=40, micro_batch_size=1)
    assert sorted(sorted(lengths[i] for i in pack) for pack in plan) == [[8], [9, 15, 16], [12, 27], [19, 20]]
    assert all(sum(lengths[i] for i in pack) <= 40 for pack in plan)
    # rounded up to the multiple: 19 + 20 = 39 -> 40 fits, 27 + 12 = 39 -> 40 fits; at 8, 40 + anything does not
    assert all(-(-sum(lengths[i] for i in pack) // 8) * 8 <= 40 for pack in plan_packs(lengths, max_tokens=40,
                                                                                          micro_batch_size=1,
                                                                                          multiple=8))
    with pytest.raises(ValueError, match="sample 0 has 27 tokens .* max_tokens=24"):
        plan_packs(lengths, max_tokens=24, micro_batch_size=1)


def test_uniform_packs_share_one_shape_and_empty_ones_fill_the_count():
    xs = _samples(SHAPES)
    mbs = make_micro_batches(xs, max_tokens=20, micro_batch_size=1, multiple=4, uniform=True, min_count=4,
                             packed=True)
    assert [mb.input_ids.shape for mb in mbs] == [(1, 20)] * 4
    assert sorted(i for mb in mbs for i in mb.sample_index) == [0, 1, 2, 3]
    empty = mbs[-1]
    assert empty.sample_index == () and empty.cu_seqlens().tolist() == [0, 20] and padding_mask(empty).all()


def test_uniform_packs_under_cp_have_one_shape_on_every_rank():
    """Two DP ranks agree on the longest sample (13 tokens, unrounded: micro_batches._local_counts) and
    pack without a budget under CP 2 (slots rounded to 4): the rank whose own slots round past the
    agreed length (13 -> 16) and the one whose do not (10 -> 12) must get one shape, which the EP ranks'
    allgather dispatcher needs; rounding only a rank's own slots gave (1, 48) against (1, 40)."""
    kw = dict(max_tokens=0, micro_batch_size=3, multiple=4, uniform=True, packed=True, segment_multiple=4,
              uniform_length=13)
    shapes = {tuple(mb.input_ids.shape) for lengths in ([(6, 7), (2, 3), (3, 3)], [(4, 6), (3, 4), (4, 5)])
              for mb in make_micro_batches(_samples(lengths), **kw)}
    assert shapes == {(1, 48)}


def test_the_launch_takes_packing_under_expert_parallelism():
    """launch_checks.check_layout, before any model is built: a Qwen3-MoE at EP 2 packed on the local spec
    passes (the Transformer Engine spec's refusal: test_packing_train_step.py; it needs CUDA first here)."""
    from megatron_dapo.config import DAPOConfig, ParallelConfig, TrainConfig
    from megatron_dapo.launch_checks import check_layout
    from tests.helpers.moe import TINY_MOE

    hf = {**TINY_MOE, "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "max_position_embeddings": 128, "norm_topk_prob": True}
    cfg = DAPOConfig(parallel=ParallelConfig(expert_model_parallel_size=2), train=TrainConfig(pack_sequences=True))
    check_layout(cfg, hf, world_size=2)
