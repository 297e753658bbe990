"""CPU checks of the vLLM engine's own logic: import guard, logprobs-mode choice, request building,
output conversion, weight-update and sleep sequencing. vLLM itself is replaced by a recording
fake with the shapes of its API (LLM, SamplingParams, RequestOutput, CompletionOutput, Logprob);
tests/gpu/test_vllm_engine.py runs the real thing.
"""

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch

from megatron_dapo.config import RolloutConfig
from megatron_dapo.rollout import SamplingParams, get_engine_cls, sequence_seed
from megatron_dapo.rollout import vllm_engine as ve


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_gives_a_clear_error():
    with pytest.raises(ImportError, match="rollout.engine=hf"):
        ve.VLLMEngine("unused", mode="standalone", eos_token_ids=(0,))
    assert get_engine_cls("vllm") is ve.VLLMEngine  # importing the module does not need vllm


@pytest.mark.parametrize("temperature,top_p,top_k,modes", [
    (1.0, 1.0, -1, {"raw_logprobs", "processed_logprobs"}),
    (1.0, 0.7, -1, {"raw_logprobs"}),          # DAPO eval: raw is exact, processed renormalises
    (1.0, 1.0, 20, {"raw_logprobs"}),
    (0.7, 1.0, -1, {"processed_logprobs"}),    # raw would be at T = 1
    (0.7, 0.9, -1, set()),                     # nothing exact
    (0.0, 1.0, -1, {"raw_logprobs"}),
])
def test_exact_logprobs_modes(temperature, top_p, top_k, modes):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    assert ve.exact_logprobs_modes(params) == modes
    chosen = ve.logprobs_mode_for(params)
    assert (chosen in modes) if modes else chosen is None


# ---------------------------------------------------------------- a recording fake of vllm
@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    index: int
    token_ids: list
    logprobs: list | None
    finish_reason: str


@dataclass
class FakeRequestOutput:
    outputs: list


@dataclass
class FakeLLM:
    kwargs: dict
    calls: list = field(default_factory=list)

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append(("generate", prompts, sampling_params))
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            completions = []
            for j in reversed(range(sp["n"])):  # out of order on purpose
                toks = [prompt["prompt_token_ids"][-1] + j, 99]
                lps = [{t: FakeLogprob(-0.5 - t)} for t in toks] if sp["logprobs"] == 0 else None
                completions.append(FakeCompletion(j, toks, lps, "stop"))
            outs.append(FakeRequestOutput(completions))
        return outs

    def apply_model(self, fn):
        self.calls.append(("apply_model", fn))
        return [fn(FakeModel())]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


class FakeModel:
    def load_weights(self, weights):
        return {name for name, _ in weights}


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = lambda **kwargs: FakeLLM(kwargs)
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return module


def test_engine_builds_llm_with_explicit_settings(fake_vllm):
    eng = ve.VLLMEngine("/ckpt", mode="standalone", eos_token_ids=(2,), tensor_parallel_size=2,
                        logprobs_mode="processed_logprobs", max_num_seqs=8)
    kw = eng.llm.kwargs
    assert kw["model"] == "/ckpt" and kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 8
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["distributed_executor_backend"] is None
    assert kw["skip_tokenizer_init"] and kw["generation_config"] == "vllm" and kw["enable_sleep_mode"]
    with pytest.raises(RuntimeError, match="torchrun"):
        ve.VLLMEngine("/ckpt", mode="colocated", eos_token_ids=(2,))


def test_from_rollout_config_picks_the_exact_mode(fake_vllm):
    cfg = RolloutConfig(temperature=1.0, top_p=0.9, tensor_parallel_size=1)
    assert ve.VLLMEngine.from_rollout_config("/ckpt", cfg, mode="standalone",
                                             eos_token_ids=(2,)).logprobs_mode == "raw_logprobs"
    cfg = RolloutConfig(temperature=0.8)
    assert ve.VLLMEngine.from_rollout_config("/ckpt", cfg, mode="standalone",
                                             eos_token_ids=(2,)).logprobs_mode == "processed_logprobs"
    with pytest.raises(ValueError, match="check_logprob_mismatch"):
        ve.VLLMEngine.from_rollout_config("/ckpt", RolloutConfig(temperature=0.8, top_p=0.9),
                                          mode="standalone", eos_token_ids=(2,))


def test_generate_seeded_requests_and_conversion(fake_vllm):
    eng = ve.VLLMEngine("/ckpt", mode="standalone", eos_token_ids=(2, 5))
    params = SamplingParams(temperature=1.0, top_p=0.7, max_tokens=9, stop_token_ids=(7,), seed=11)
    out = eng.generate([[1, 10], [20]], n=2, params=params)
    _, prompts, sps = eng.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 10], [1, 10], [20], [20]]
    assert [sp["seed"] for sp in sps] == [sequence_seed(11, i, k) for i in range(2) for k in range(2)]
    assert all(sp["n"] == 1 and sp["stop_token_ids"] == [2, 5, 7] and sp["logprobs"] == 0
               and sp["top_p"] == 0.7 and sp["max_tokens"] == 9 and not sp["detokenize"] for sp in sps)
    assert [[r.response_ids for r in g] for g in out] == [[[10, 99], [10, 99]], [[20, 99], [20, 99]]]
    assert out[1][0].logprobs == [-20.5, -99.5] and out[1][0].finish_reason == "stop"
    assert out[0][0].prompt_ids == [1, 10]


def test_generate_unseeded_uses_n_and_sorts_completions(fake_vllm):
    eng = ve.VLLMEngine("/ckpt", mode="standalone", eos_token_ids=(2,))
    out = eng.generate([[4]], n=3, params=SamplingParams(max_tokens=3, logprobs=False))
    _, _, sps = eng.llm.calls[-1]
    assert len(sps) == 1 and sps[0]["n"] == 3 and sps[0]["seed"] is None and sps[0]["logprobs"] is None
    assert [r.response_ids[0] for r in out[0]] == [4, 5, 6] and out[0][0].logprobs == []


def test_generate_refuses_inexact_logprobs(fake_vllm):
    eng = ve.VLLMEngine("/ckpt", mode="standalone", eos_token_ids=(2,), logprobs_mode="raw_logprobs")
    with pytest.raises(ValueError, match="processed_logprobs"):
        eng.generate([[1]], n=1, params=SamplingParams(temperature=0.7))
    eng.generate([[1]], n=1, params=SamplingParams(temperature=0.7, logprobs=False))  # fine


def test_weight_update_and_sleep_sequencing(fake_vllm):
    eng = ve.VLLMEngine("/ckpt", mode="standalone", eos_token_ids=(2,))
    eng.sleep()
    eng.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.generate([[1]], n=1, params=SamplingParams())
    eng.update_weights([("model.norm.weight", torch.ones(3, requires_grad=True))])
    eng.update_weights([("lm_head.weight", torch.ones(2))])
    eng.wake_up()
    eng.wake_up()  # nothing left to wake
    eng.update_weights([("lm_head.weight", torch.ones(2))])  # awake: stale prefix cache is reset
    names = [c[0] for c in eng.llm.calls]
    assert names == ["sleep", "wake_up", "apply_model", "apply_model", "wake_up", "apply_model",
                     "reset_prefix_cache"]
    assert eng.llm.calls[1] == ("wake_up", ["weights"]) and eng.llm.calls[4] == ("wake_up", ["kv_cache"])
    fn = eng.llm.calls[2][1]
    assert isinstance(fn, partial) and fn.func is ve._load_weights  # picklable for worker RPC
    (name, tensor), = fn.keywords["weights"]
    assert name == "model.norm.weight" and not tensor.requires_grad


def test_to_rollout_rejects_aborted():
    with pytest.raises(RuntimeError, match="abort"):
        ve.to_rollout([1], FakeCompletion(0, [3], None, "abort"), want_logprobs=False)
