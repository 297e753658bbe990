"""Bucketed weight streaming, the engine-vs-trainer mismatch metric, the teacher-forced scorer."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.rollout import bucketed, logprob_mismatch, score_logprobs, sync_weights
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.weight_sync import tensor_bytes
from tests.helpers.rollout import tiny_qwen2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_rollout_hf_engine.one_thread
    yield
    torch.set_num_threads(before)


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 40), max_size=25), limit=st.integers(1, 200),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_bucketed_respects_limit_and_preserves_every_tensor(numels, limit, dtype):
    weights = [(f"w{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(numels)]
    buckets = list(bucketed(iter(weights), limit))
    flat = [pair for b in buckets for pair in b]
    assert [name for name, _ in flat] == [name for name, _ in weights]
    assert all(a is b for (_, a), (_, b) in zip(flat, weights))  # no copies
    for b in buckets:
        size = sum(tensor_bytes(t) for _, t in b)
        assert size <= limit or len(b) == 1  # an oversized tensor travels alone
        assert b
    # Greedy: a bucket closes only when the next tensor would overflow it.
    for b, nxt in zip(buckets, buckets[1:]):
        assert sum(tensor_bytes(t) for _, t in b) + tensor_bytes(nxt[0][1]) > limit


def test_bucketed_hand_case_and_laziness():
    consumed = []

    def source():
        for i, n in enumerate([2, 2, 3, 10, 1]):
            consumed.append(i)
            yield f"w{i}", torch.zeros(n)  # fp32: 4 bytes each

    it = bucketed(source(), bucket_bytes=16)
    assert [n for n, _ in next(it)] == ["w0", "w1"]
    assert consumed == [0, 1, 2]  # one look-ahead tensor, not the whole stream
    assert [[n for n, _ in b] for b in it] == [["w2"], ["w3"], ["w4"]]
    with pytest.raises(ValueError):
        list(bucketed([], 0))


def test_sync_weights_streams_buckets_into_the_engine():
    source, engine = tiny_qwen2(1), HFEngine(tiny_qwen2(0), eos_token_ids=())
    calls = []
    real_update = engine.update_weights
    engine.update_weights = lambda bucket: (calls.append(len(bucket)), real_update(bucket))
    state = source.state_dict()
    limit = 32 * 64 * 4  # one MLP matrix: several buckets
    stats = sync_weights(engine, state.items(), limit)
    assert stats == {"num_buckets": len(calls), "num_tensors": len(state),
                     "num_bytes": sum(tensor_bytes(t) for t in state.values())}
    assert len(calls) > 3 and sum(calls) == len(state)
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, state[name]), name


def test_logprob_mismatch_hand_values():
    engine = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 7.0, float("nan")]])
    trainer = torch.tensor([[-1.1, -1.7, 5.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = logprob_mismatch(engine, trainer, mask)
    # Valid diffs: 0.1, 0.3, 0.0 (masked: 5.0, 8.0, nan).
    expected = (math.exp(0.1) + math.exp(0.3) + 1) / 3
    assert m["rollout/logprob_mismatch"].item() == pytest.approx(expected, abs=1e-6)
    assert m["rollout/logprob_abs_diff_mean"].item() == pytest.approx(0.4 / 3, abs=1e-6)
    assert m["rollout/logprob_abs_diff_max"].item() == pytest.approx(0.3, abs=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_logprob_mismatch_edge_cases():
    x = torch.randn(2, 4, requires_grad=True)
    same = logprob_mismatch(x, x.detach().clone(), torch.ones(2, 4, dtype=torch.bool))
    assert same["rollout/logprob_mismatch"].item() == 1.0
    assert same["rollout/logprob_abs_diff_max"].item() == 0.0
    empty = logprob_mismatch(x, x + 3, torch.zeros(2, 4))
    assert [v.item() for v in empty.values()] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(x, x[:, :3], torch.ones(2, 4))


def test_score_logprobs_batched_equals_one_by_one():
    model = tiny_qwen2(0)
    prompts, responses = [[1, 2, 3], [9], [4, 5]], [[7, 8], [10, 11, 12, 13], []]
    batched = score_logprobs(model, prompts, responses, temperature=0.8)
    assert [len(b) for b in batched] == [2, 4, 0]
    for p, r, got in zip(prompts, responses, batched):
        if not r:
            continue
        logits = model(input_ids=torch.tensor([p + r])).logits[0]
        rows = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        ref = torch.log_softmax(logits / 0.8, -1)[rows, torch.tensor(r)]
        torch.testing.assert_close(torch.tensor(got), ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        score_logprobs(model, [[1]], [[2], [3]], 1.0)
