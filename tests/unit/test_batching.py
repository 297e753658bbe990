"""Micro-batching of rollout samples (batching.py): pure torch, no model.

Checked against the samples themselves: every token lands once, in its row; the label of
position t is input t + 1; the loss mask selects exactly the response tokens (and carries a
given response mask, old and rollout log-probs and advantages to the same positions); budgets and padding
multiples hold; the same input always gives the same micro-batches.
"""

import dataclasses
import random

import pytest
import torch

from megatron_dapo.batching import (
    Sample,
    build_micro_batch,
    count_micro_batches,
    make_micro_batches,
    pad_multiple,
    plan_micro_batches,
    split_for_data_parallel,
    unpack_responses,
)


def samples(seed: int, n: int, max_prompt: int = 9, max_response: int = 17) -> list[Sample]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(1, max_prompt), rng.randint(0, max_response)
        mask = (torch.rand(r, generator=g) > 0.2).float() if rng.random() < 0.5 else None
        adv = torch.randn(r, generator=g) if rng.random() < 0.5 else rng.uniform(-1, 1)
        engine = -torch.rand(r, generator=g) - 0.01 if rng.random() < 0.7 else None  # the engine's, if any
        out.append(Sample(prompt_ids=torch.randint(1, 100, (p,), generator=g),
                          response_ids=torch.randint(1, 100, (r,), generator=g),
                          advantages=adv, old_log_probs=-torch.rand(r, generator=g), loss_mask=mask,
                          rollout_log_probs=engine))
    return out


def check_rows(xs: list[Sample], mbs) -> None:
    """Every sample once; ids, labels, mask, old / rollout log-probs and advantages where they belong."""
    seen = []
    for mb in mbs:
        b, s = mb.input_ids.shape
        for t in (mb.position_ids, mb.labels, mb.loss_mask, mb.old_log_probs, mb.rollout_log_probs,
                  mb.advantages):
            assert t.shape == (b, s)
        assert mb.rollout_log_probs.dtype == torch.float32
        assert torch.equal(mb.position_ids, torch.arange(s).expand(b, s))
        for row, i in enumerate(mb.sample_index):
            if i < 0:
                assert mb.loss_mask[row].sum() == 0 and mb.input_ids[row].sum() == 0
                assert mb.rollout_log_probs[row].count_nonzero() == 0
                continue
            seen.append(i)
            x = xs[i]
            p, r, n = x.num_prompt_tokens, x.num_response_tokens, x.num_tokens
            full = torch.cat([x.prompt_ids, x.response_ids])
            assert torch.equal(mb.input_ids[row, :n], full) and mb.input_ids[row, n:].sum() == 0
            # the token predicted at position t is input t + 1
            assert torch.equal(mb.labels[row, : n - 1], mb.input_ids[row, 1:n])
            assert mb.labels[row, n - 1:].sum() == 0
            response_mask = torch.ones(r) if x.loss_mask is None else x.loss_mask
            expect = torch.zeros(s)
            expect[p - 1: p - 1 + r] = response_mask
            assert torch.equal(mb.loss_mask[row], expect)
            assert torch.equal(mb.labels[row, p - 1: p - 1 + r], x.response_ids)  # labels of the span
            assert torch.equal(mb.old_log_probs[row, p - 1: p - 1 + r], x.old_log_probs)
            adv = torch.as_tensor(x.advantages).float().expand(r)
            assert torch.equal(mb.advantages[row, p - 1: p - 1 + r], adv)
            assert mb.old_log_probs[row].count_nonzero() <= r
            # the engine's log-probs: on the response span exactly (all nonzero there), 0 elsewhere
            # and where the sample has none
            engine = torch.zeros(s)
            if x.rollout_log_probs is not None:
                engine[p - 1: p - 1 + r] = x.rollout_log_probs
            assert torch.equal(mb.rollout_log_probs[row], engine)
    assert sorted(seen) == list(range(len(xs)))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget,multiple", [(64, 1), (48, 8), (100, 4)])
def test_token_budget_packing(seed, budget, multiple):
    xs = samples(seed, 23)
    mbs = make_micro_batches(xs, max_tokens=budget, micro_batch_size=1, multiple=multiple)
    check_rows(xs, mbs)
    for mb in mbs:
        assert mb.num_padded_tokens <= budget and mb.input_ids.shape[1] % multiple == 0
        longest = max(xs[i].num_tokens for i in mb.sample_index)
        assert mb.input_ids.shape[1] == -(-longest // multiple) * multiple
    # packing does real work: far fewer micro-batches than samples, and no worse than twice the
    # lower bound (total padded tokens / budget)
    total = sum(-(-x.num_tokens // multiple) * multiple for x in xs)
    assert len(mbs) <= 2 * -(-total // budget) + 1 < len(xs)
    again = make_micro_batches(xs, max_tokens=budget, micro_batch_size=1, multiple=multiple)
    assert [m.sample_index for m in again] == [m.sample_index for m in mbs]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, mbs))


def test_fixed_micro_batch_size_keeps_order():
    xs = samples(1, 7)
    mbs = make_micro_batches(xs, max_tokens=0, micro_batch_size=3)
    assert [m.sample_index for m in mbs] == [(0, 1, 2), (3, 4, 5), (6,)]
    check_rows(xs, mbs)


def test_first_fit_decreasing_plan():
    # lengths 10, 9, 6, 5, 3 into 20 tokens: 10 takes row 1 of group A (2 rows x 10), 9 joins A;
    # 6 opens B (3 rows x 6 = 18), 5 and 3 join B.
    assert plan_micro_batches([6, 10, 3, 9, 5], max_tokens=20, micro_batch_size=1) == [[1, 3], [0, 2, 4]]
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        plan_micro_batches([6, 21], max_tokens=20, micro_batch_size=1)
    with pytest.raises(ValueError, match="padded to a multiple of 8"):
        plan_micro_batches([17], max_tokens=20, micro_batch_size=1, multiple=8)


def test_padding_to_a_common_count():
    xs = samples(2, 3)
    mbs = make_micro_batches(xs, max_tokens=0, micro_batch_size=2, multiple=4, min_count=5, count_multiple=2)
    assert len(mbs) == 6 and [m.sample_index for m in mbs[2:]] == [(-1,)] * 4
    assert all(m.input_ids.shape == (1, 4) and m.loss_mask.sum() == 0 for m in mbs[2:])
    check_rows(xs, mbs)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=64, micro_batch_size=1, multiple=8),
                                    dict(max_tokens=0, micro_batch_size=3, min_count=9, count_multiple=4),
                                    dict(max_tokens=96, micro_batch_size=1, uniform=True, count_multiple=3)])
def test_count_micro_batches_without_building_them(kwargs):
    """The count train_step exchanges ahead of an update (batch_counts) is what it then builds."""
    for n in (0, 1, 7, 23):
        xs = samples(n, n)
        assert count_micro_batches(xs, **kwargs) == len(make_micro_batches(xs, **kwargs))


def test_unpack_responses_inverts_the_layout():
    xs = samples(3, 11)
    mbs = make_micro_batches(xs, max_tokens=40, micro_batch_size=1, min_count=6)
    back = unpack_responses([m.labels.float() for m in mbs], mbs, len(xs))
    assert len(back) == len(xs) and all(torch.equal(v, x.response_ids.float()) for v, x in zip(back, xs))
    with pytest.raises(ValueError, match="in none of the micro-batches"):
        unpack_responses([m.labels for m in mbs[:1]], mbs[:1], len(xs))


def test_split_for_data_parallel_balances_tokens():
    xs = samples(4, 17)
    shards = split_for_data_parallel(xs, 3)
    assert sorted(i for s in shards for i in s) == list(range(17))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(xs[i].num_tokens for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(x.num_tokens for x in xs)
    assert split_for_data_parallel(xs, 3) == shards
    assert split_for_data_parallel(xs[:2], 3)[2] == []  # more ranks than samples: an empty shard


def test_pad_multiple_and_validation():
    assert pad_multiple() == 1
    assert pad_multiple(tensor_parallel=4, sequence_parallel=True) == 4
    assert pad_multiple(tensor_parallel=4, sequence_parallel=True, context_parallel=2, base=8) == 8
    assert pad_multiple(tensor_parallel=3, sequence_parallel=True, context_parallel=2) == 12
    # sequence parallelism splits each CP rank's share over TP: TP x CP | s (the 32k recipe: TP 8, CP 2)
    assert pad_multiple(tensor_parallel=4, sequence_parallel=True, context_parallel=2) == 8
    assert pad_multiple(tensor_parallel=8, sequence_parallel=True, context_parallel=2) == 16
    assert pad_multiple(tensor_parallel=8, sequence_parallel=False, context_parallel=2) == 4
    for tp in (1, 2, 3, 4, 8):
        for cp in (1, 2, 3, 4):
            m = pad_multiple(tensor_parallel=tp, sequence_parallel=True, context_parallel=cp)
            assert (m // cp) % tp == 0 and (m % (2 * cp) == 0 or cp == 1), (tp, cp, m)
    with pytest.raises(ValueError, match="P >= 1"):
        Sample(prompt_ids=torch.zeros(0, dtype=torch.long), response_ids=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="old_log_probs"):
        Sample(prompt_ids=torch.ones(2, dtype=torch.long), response_ids=torch.ones(2, dtype=torch.long),
               old_log_probs=torch.zeros(3))
    with pytest.raises(ValueError, match=r"rollout_log_probs must have shape \[R\] = \(2,\)"):
        Sample(prompt_ids=torch.ones(2, dtype=torch.long), response_ids=torch.ones(2, dtype=torch.long),
               rollout_log_probs=torch.zeros(2, 1))
    empty = build_micro_batch([], [], multiple=8)
    assert empty.input_ids.shape == (1, 8) and empty.sample_index == (-1,)


def test_rollout_log_probs_follow_the_old_ones():
    """Packed exactly like old_log_probs: with both equal per sample the two tensors are equal."""
    xs = [dataclasses.replace(x, rollout_log_probs=x.old_log_probs.clone()) for x in samples(5, 13)]
    for kw in (dict(max_tokens=48, multiple=4), dict(max_tokens=0, micro_batch_size=3, uniform=True)):
        mbs = make_micro_batches(xs, **{"micro_batch_size": 1, **kw}, min_count=6)
        check_rows(xs, mbs)
        assert all(torch.equal(m.rollout_log_probs, m.old_log_probs) for m in mbs)
        back = unpack_responses([m.rollout_log_probs for m in mbs], mbs, len(xs))
        assert len(back) == len(xs) and all(torch.equal(v, x.rollout_log_probs) for v, x in zip(back, xs))


@pytest.mark.parametrize("tp,sp,cp", [(1, False, 1), (2, True, 1), (4, True, 1), (8, True, 1), (4, False, 1),
                                      (2, True, 2)])
def test_fp8_padding_gives_every_gemm_rows_divisible_by_16_on_variable_length_batches(tp, sp, cp):
    """Real RL micro-batches: variable lengths, token-budget packing, any number of rows. Each rank's
    GEMM input is [s / (TP if SP) / CP, b, h]; TE needs its rows (all dims but the last) % 16 == 0."""
    g = torch.Generator().manual_seed(tp * 10 + cp)
    samples = [Sample(prompt_ids=torch.ones(int(torch.randint(3, 40, (1,), generator=g))),
                      response_ids=torch.ones(int(torch.randint(1, 300, (1,), generator=g)))) for _ in range(64)]
    multiple = pad_multiple(tensor_parallel=tp, sequence_parallel=sp, context_parallel=cp, fp8=True)
    mbs = make_micro_batches(samples, max_tokens=4096, micro_batch_size=1, multiple=multiple)
    assert len(mbs) > 3 and len({mb.input_ids.shape[1] for mb in mbs}) > 1  # really variable
    for mb in mbs:
        b, s = mb.input_ids.shape
        share = s // ((tp if sp else 1) * cp)
        assert s % ((tp if sp else 1) * cp) == 0 and (share * b) % 16 == 0 and share % 16 == 0, (b, s)
    # without the FP8 term the same batches would break the rule
    plain = make_micro_batches(samples, max_tokens=4096, micro_batch_size=1,
                               multiple=pad_multiple(tensor_parallel=tp, sequence_parallel=sp, context_parallel=cp))
    assert any((mb.input_ids.shape[1] // ((tp if sp else 1) * cp) * mb.input_ids.shape[0]) % 16 for mb in plain)


def test_fp8_on_cpu_is_refused_in_one_line(tmp_path, capsys):
    from megatron_dapo import cli

    rc = cli.main(["train", "--config", "conf/cpu_tiny.yaml", f"logging.dir={tmp_path / 'run'}", "model.fp8=e4m3"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.fp8" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_samples_without_old_log_probs_get_zeros_there():
    """A forward-only pass builds micro-batches from samples without pi_old: zeros on their span,
    the others' values on theirs (the rows are filled by one scatter, not row by row)."""
    xs = samples(4, 6)
    xs = [dataclasses.replace(x, old_log_probs=None) if i % 2 else x for i, x in enumerate(xs)]
    mb = build_micro_batch(xs, list(range(len(xs))), multiple=4, shape=(8, 32))
    for row, x in enumerate(xs):
        p, r = x.num_prompt_tokens, x.num_response_tokens
        expect = torch.zeros(32)
        if x.old_log_probs is not None:
            expect[p - 1: p - 1 + r] = x.old_log_probs
        assert torch.equal(mb.old_log_probs[row], expect)
        assert torch.equal(mb.input_ids[row, : p + r], torch.cat([x.prompt_ids, x.response_ids]))
    assert mb.input_ids[len(xs):].count_nonzero() == 0 and mb.sample_index[len(xs):] == (-1, -1)
