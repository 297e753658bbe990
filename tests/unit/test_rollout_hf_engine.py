"""HF-transformers rollout engine: seeding, left padding, log-prob contract, stops, weight updates."""

import threading
import time

import pytest
import torch

from megatron_dapo.rollout import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    get_engine_cls,
    score_logprobs,
    sequence_seed,
)
from megatron_dapo.rollout import hf_engine
from megatron_dapo.rollout.hf_engine import HFEngine, sample_next, truncate_logits
from tests.helpers.rollout import VOCAB, tiny_qwen2

PROMPTS = [[5, 17, 42], [7], [100, 101, 102, 103, 104, 105, 106], [3, 3]]
STOPS = tuple(range(0, VOCAB, 7))  # about 1 token in 7 ends a response: rows stop at different steps


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core box OpenMP barriers made
    them ~7x slower (measured); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(tiny_qwen2(0), eos_token_ids=(), max_batch_size=64)


def assert_same(a: list[Rollout], b: list[Rollout], atol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.prompt_ids == y.prompt_ids
        assert x.response_ids == y.response_ids
        assert x.finish_reason == y.finish_reason
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


def test_engine_satisfies_protocol_and_registry(engine):
    assert isinstance(engine, RolloutEngine)
    assert get_engine_cls("hf") is HFEngine


def test_same_seed_same_outputs_and_new_seed_new_outputs(engine):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123)
    first = engine.generate(PROMPTS, n=3, params=params)
    again = engine.generate(PROMPTS, n=3, params=params)
    other = engine.generate(PROMPTS, n=3, params=SamplingParams(temperature=1.0, max_tokens=12, seed=124))
    assert [len(group) for group in first] == [3] * len(PROMPTS)
    assert len(again) == len(first)
    for g1, g2 in zip(first, again):
        assert_same(g1, g2, atol=0.0)
    flat = lambda groups: [r.response_ids for g in groups for r in g]  # noqa: E731
    assert flat(first) != flat(other)
    # The n samples of one prompt use different streams.
    assert len({tuple(r.response_ids) for r in first[0]}) > 1


def test_global_seed_pins_unseeded_generation(engine):
    params = SamplingParams(max_tokens=6)
    torch.manual_seed(7)
    a = engine.generate(PROMPTS[:2], n=2, params=params)
    torch.manual_seed(7)
    b = engine.generate(PROMPTS[:2], n=2, params=params)
    torch.manual_seed(8)
    c = engine.generate(PROMPTS[:2], n=2, params=params)
    assert [len(g) for g in a] == [len(g) for g in b] == [2, 2]  # the loop below has groups to compare
    for g1, g2 in zip(a, b):
        assert_same(g1, g2, atol=0.0)
    # The global seed is what pins them: another one samples other responses.
    flat = lambda groups: [r.response_ids for g in groups for r in g]  # noqa: E731
    assert flat(c) != flat(a)


@pytest.mark.parametrize("top_p,top_k", [(1.0, -1), (0.8, 20)])
def test_left_padded_batch_equals_one_at_a_time(engine, top_p, top_k):
    params = SamplingParams(temperature=0.9, top_p=top_p, top_k=top_k, max_tokens=10)
    seeds = [11, 22, 33, 44]
    batched = engine.sample(PROMPTS, seeds, params)
    alone = [engine.sample([p], [s], params)[0] for p, s in zip(PROMPTS, seeds)]
    assert_same(batched, alone)
    # generate() is sample() with sequence_seed streams, whatever the chunk size.
    chunked = HFEngine(engine.model, eos_token_ids=(), max_batch_size=3)
    groups = chunked.generate(PROMPTS, n=2, params=SamplingParams(
        temperature=0.9, top_p=top_p, top_k=top_k, max_tokens=10, seed=5))
    expected = engine.sample([p for p in PROMPTS for _ in range(2)],
                             [sequence_seed(5, i, k) for i in range(len(PROMPTS)) for k in range(2)], params)
    assert_same([r for g in groups for r in g], expected)


def test_random_streams_drawn_in_blocks_equal_one_draw_per_step(engine, monkeypatch):
    """_RaceBlocks draws several steps' exponentials per call, for live rows only; the reference
    draws one step at a time for every row inside sample_next (race_BV=None, the per-step path).
    Same responses, bit for bit, whatever the block schedule: blocks of 1, of 3 (a cap that splits
    the 12 steps unevenly), of all 12 steps, and growing ones (1, 2, 4, 5; 8, 4). Stop tokens end
    rows at different steps, so finished rows skip draws and the batch is compacted."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=9, stop_token_ids=STOPS)
    prompts, seeds = [p for p in PROMPTS for _ in range(4)], list(range(4 * len(PROMPTS)))
    monkeypatch.setattr(hf_engine._RaceBlocks, "at", lambda self, step, live: None)  # sample_next draws
    reference = engine.sample(prompts, seeds, params)
    monkeypatch.undo()
    lengths = [len(r.response_ids) for r in reference]
    assert min(lengths) < 4 and max(lengths) > 8, lengths  # rows finish early and late (past a block of 8)
    vocab = engine.model.config.vocab_size
    for first, cap in ((1, 1), (3, 3), (12, 12), (1, 12), (8, 12)):
        budget = cap * len(prompts) * vocab
        monkeypatch.setattr(hf_engine._RaceBlocks.__init__, "__defaults__", (budget, first))
        race = hf_engine._RaceBlocks([torch.Generator()] * len(prompts), 12, vocab)
        assert (race.cap, race.block) == (cap, min(first, cap))
        assert_same(engine.sample(prompts, seeds, params), reference, atol=0.0)


def test_race_blocks_draw_only_live_rows():
    """A row that has finished draws nothing more: its generator stays where it was."""
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    race = hf_engine._RaceBlocks(gens, max_tokens=6, vocab=5, first=2)
    first = race.at(0, [True, True])
    assert race.at(1, [True, True]).shape == (2, 5)
    state = gens[1].get_state()
    third = race.at(2, [True, False])  # row 1 finished before the second block
    assert torch.equal(gens[1].get_state(), state) and torch.equal(third[1], torch.ones(5))
    expected = torch.empty(3, 5).exponential_(generator=torch.Generator().manual_seed(1))
    assert torch.equal(first[0], expected[0]) and torch.equal(third[0], expected[2])
    race.keep([0])
    assert race.at(3, [True]).shape == (1, 5)


def test_compacted_batch_equals_one_at_a_time(engine):
    """Rows that finish leave the decode batch (KV cache, mask and race compacted); the responses
    still equal each row decoded alone (tokens exactly, log-probs to fp32 summation order)."""
    params = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=STOPS)
    prompts, seeds = [p for p in PROMPTS for _ in range(4)], [100 + i for i in range(4 * len(PROMPTS))]
    batched = engine.sample(prompts, seeds, params)
    lengths = sorted(len(r.response_ids) for r in batched)
    middle = lengths[len(lengths) // 2]
    assert middle < 12 and lengths[-1] > middle, lengths  # rows finished at different steps: compaction ran
    assert_same(batched, [engine.sample([p], [s], params)[0] for p, s in zip(prompts, seeds)])


@pytest.mark.parametrize("temperature,top_p,top_k",
                         [(1.0, 1.0, -1), (0.7, 0.8, 20), (1.3, 0.5, -1), (0.6, 1.0, 5)])
def test_logprobs_are_unmodified_distribution_at_temperature(engine, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=10, seed=3)
    rollouts = [r for g in engine.generate(PROMPTS, n=2, params=params) for r in g]
    forced = score_logprobs(engine.model, [r.prompt_ids for r in rollouts],
                            [r.response_ids for r in rollouts], temperature)
    assert len(rollouts) == len(forced) == 2 * len(PROMPTS)
    for r, ref in zip(rollouts, forced):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-5, rtol=0)
    if top_p < 1 or top_k != -1:
        # Truncation was active: every sampled token lies in the support, and the reported
        # log-probs are not the renormalised ones (some kept mass is < 1).
        kept_mass = []
        for r in rollouts:
            seq = torch.tensor([r.prompt_ids + r.response_ids])
            logits = engine.model(input_ids=seq).logits[0].float() / temperature
            start = len(r.prompt_ids) - 1
            for t, tok in enumerate(r.response_ids):
                x = truncate_logits(logits[start + t][None], top_k, top_p)[0]
                assert torch.isfinite(x[tok])
                kept_mass.append(torch.softmax(logits[start + t], -1)[torch.isfinite(x)].sum().item())
        assert min(kept_mass) < 0.99


def test_greedy_reports_temperature_one_logprobs(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    r = engine.generate(PROMPTS[:1], n=1, params=params)[0][0]
    seq = torch.tensor([r.prompt_ids + r.response_ids])
    logits = engine.model(input_ids=seq).logits[0]
    start = len(r.prompt_ids) - 1
    assert r.response_ids == [int(logits[start + t].argmax()) for t in range(len(r.response_ids))]
    ref = score_logprobs(engine.model, [r.prompt_ids], [r.response_ids], temperature=1.0)[0]
    torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-5, rtol=0)


def test_stop_token_ends_the_response_and_length_cap(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    free = engine.generate([PROMPTS[2]], n=1, params=greedy)[0][0]
    assert free.finish_reason == "length" and len(free.response_ids) == 8
    stop_tok = free.response_ids[3]
    first = free.response_ids.index(stop_tok)
    stopped = engine.generate([PROMPTS[2]], n=1, params=SamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=(stop_tok,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == free.response_ids[:first + 1]  # the stop token is kept
    assert stopped.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-6)
    # The engine's EOS ids stop too, and rows of a batch stop independently.
    eos_engine = HFEngine(engine.model, eos_token_ids=(stop_tok,))
    batch = [g[0] for g in eos_engine.generate([PROMPTS[2], PROMPTS[0]], n=1, params=greedy)]
    assert_same([batch[0]], [stopped])
    other = engine.generate([PROMPTS[0]], n=1, params=greedy)[0][0]
    ids = other.response_ids
    cut = ids.index(stop_tok) + 1 if stop_tok in ids else len(ids)
    assert batch[1].response_ids == other.response_ids[:cut]


def test_max_tokens_one(engine):
    r = engine.generate(PROMPTS, n=1, params=SamplingParams(max_tokens=1, seed=0))
    for g in r:
        assert len(g[0].response_ids) == 1 == len(g[0].logprobs) and g[0].finish_reason == "length"


def test_logprobs_off_returns_empty_lists(engine):
    r = engine.generate(PROMPTS[:1], n=2, params=SamplingParams(max_tokens=4, seed=0, logprobs=False))
    assert all(x.logprobs == [] and len(x.response_ids) == 4 for x in r[0])


def test_update_weights_matches_a_model_built_with_those_weights():
    target = tiny_qwen2(1)
    eng = HFEngine(tiny_qwen2(0), eos_token_ids=())
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=9)
    before = eng.generate(PROMPTS, n=2, params=params)
    eng.update_weights(target.state_dict().items())
    after = eng.generate(PROMPTS, n=2, params=params)
    reference = HFEngine(target, eos_token_ids=()).generate(PROMPTS, n=2, params=params)
    assert len(after) == len(reference) == len(PROMPTS)
    for g1, g2 in zip(after, reference):
        assert_same(g1, g2, atol=1e-6)
    assert [r.response_ids for g in before for r in g] != [r.response_ids for g in after for r in g]


def test_update_weights_tied_embeddings_accepts_either_name():
    eng = HFEngine(tiny_qwen2(0, tie=True), eos_token_ids=())
    new = torch.randn(VOCAB, 32)
    eng.update_weights([("lm_head.weight", new)])
    assert torch.equal(eng.model.model.embed_tokens.weight, new)


def test_update_weights_rejects_unknown_names_and_shapes_without_copying():
    eng = HFEngine(tiny_qwen2(0), eos_token_ids=())
    snapshot = {k: v.clone() for k, v in eng.model.state_dict().items()}
    good = ("model.norm.weight", torch.zeros(32))
    with pytest.raises(ValueError, match="model.layers.0.nope"):
        eng.update_weights([good, ("model.layers.0.nope", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: got \(5, 32\)"):
        eng.update_weights([good, ("model.embed_tokens.weight", torch.zeros(5, 32))])
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


def test_sample_next_draws_from_the_truncated_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    counts = torch.zeros(4)
    for s in range(3000):
        tok, lp = sample_next(logits, params, [torch.Generator().manual_seed(s)])
        counts[tok] += 1
        assert lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, tok].item())
    freq = counts / counts.sum()
    # top_p 0.7 keeps {0.5, 0.3} renormalised to {0.625, 0.375}; 3000 draws: sd ~ 0.009.
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.04, rtol=0)


def test_truncate_logits_hand_cases():
    x = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    finite = lambda y: torch.isfinite(y)[0].tolist()  # noqa: E731
    assert finite(truncate_logits(x, top_k=2, top_p=1.0)) == [False, True, False, True]
    assert finite(truncate_logits(x, top_k=-1, top_p=0.7)) == [False, True, False, True]
    assert finite(truncate_logits(x, top_k=-1, top_p=0.9)) == [False, True, True, True]
    assert finite(truncate_logits(x, top_k=-1, top_p=0.01)) == [False, True, False, False]
    # top-p acts on the top-k-renormalised distribution: {0.5, 0.3} -> {0.625, 0.375}.
    assert finite(truncate_logits(x, top_k=2, top_p=0.6)) == [False, True, False, False]
    assert finite(truncate_logits(x, top_k=-1, top_p=1.0)) == [True] * 4


def test_argument_validation(engine):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], n=1, params=SamplingParams())
    with pytest.raises(ValueError, match="n must be"):
        engine.generate([[1]], n=0, params=SamplingParams())
    with pytest.raises(ValueError, match="logprobs for"):
        Rollout(prompt_ids=[1], response_ids=[2, 3], logprobs=[-1.0], finish_reason="stop")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_sampling_params_from_configs():
    from megatron_dapo.config import EvalConfig, RolloutConfig
    from megatron_dapo.rollout import eval_sampling_params, rollout_sampling_params

    train = rollout_sampling_params(RolloutConfig(top_k=50, max_response_length=64), seed=1)
    assert (train.temperature, train.top_k, train.max_tokens) == (1.0, 50, 64)
    assert train.seed == 1 and train.logprobs
    ev = eval_sampling_params(EvalConfig(), max_tokens=20480, stop_token_ids=[9])
    assert (ev.temperature, ev.top_p, ev.top_k, ev.max_tokens) == (1.0, 0.7, -1, 20480)
    assert ev.stop_token_ids == (9,) and not ev.logprobs


def test_abort_ends_the_running_generate_at_its_next_token_and_every_later_one():
    """abort() from another thread (rollout/separate.py's stop): the generate running raises
    GenerationAborted at its next decode step instead of finishing its tokens, and so does every
    later call. The abort is sent from a forward, i.e. while the batch is being decoded."""
    from megatron_dapo.rollout.engine import GenerationAborted

    eng = HFEngine(tiny_qwen2(0), eos_token_ids=(), max_batch_size=64)
    forwards = []
    real_forward = eng._forward

    def forward(*args):
        forwards.append(1)
        if len(forwards) == 3:  # the prefill and two decode steps done
            threading.Thread(target=eng.abort).start()
            time.sleep(0.2)  # the abort lands before the next token
        return real_forward(*args)

    eng._forward = forward
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=1)
    with pytest.raises(GenerationAborted):
        eng.generate(PROMPTS, n=2, params=params)
    assert len(forwards) == 3, "the generate went on decoding after the abort"
    with pytest.raises(GenerationAborted):
        eng.generate(PROMPTS, n=2, params=params)
    assert len(forwards) == 3  # a later call stops before its prefill
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    assert HFEngine.aborts and VLLMEngine.aborts  # vLLM's: tests/unit/test_rollout_vllm_engine.py
