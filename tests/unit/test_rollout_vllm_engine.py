"""The vLLM rollout engine against the real vllm (the CPU build, ./install.sh vllm), in this process.

Two engines for the whole module (each costs ~5-10 s to build, plus a one-off warm-up): an untied
tiny Qwen2 built with the constructor (raw log-probs), and a tied one built with from_spec at
T = 0.7 (processed log-probs). The reference is the same weights in HF transformers, fp32,
teacher-forced (weight_sync.score_logprobs). Both compute in fp32 on the CPU; the largest
difference measured (5 seeds x 16 responses x 24 tokens, before and after a sync, raw and
processed) is 3.6e-5: the models' logits are large (weights ~N(0, 0.3)). TOL = 1e-4.

The pure-logic tests at the top need no vllm; the rest skip, with the reason, when it is missing.
"""

import dataclasses
import importlib.util
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.config import (
    DAPOConfig, DataConfig, MoEConfig, OverlongBufferConfig, RewardConfig, RolloutConfig,
    TrainConfig,
)
from megatron_dapo.errors import ConfigError
from megatron_dapo.rollout import SamplingParams, get_engine_cls, score_logprobs, sync_weights
from megatron_dapo.rollout import vllm_checks
from megatron_dapo.rollout import vllm_engine as ve
from megatron_dapo.rollout.engine import EngineSpec, GenerationAborted

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (./install.sh vllm installs "
                                                      "its CPU build); these tests run the real engine")

TOL = 1e-4
EOS = 1
VOCAB = 120
PROMPTS = [[5, 17, 42, 8], [7, 9], [100, 101, 102, 103, 104, 105, 106], [3]]
KV_MB = 16
SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker replaces it; the engine puts it back


# ---------------------------------------------------------------- pure logic (no vllm)
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


def test_dtype_layout_and_memory_rules():
    assert ve.vllm_dtype("auto", on_gpu=False) == "float32"
    assert ve.vllm_dtype("auto", on_gpu=True) == "bfloat16"
    assert ve.vllm_dtype("fp32", on_gpu=True) == "float32"
    assert ve.vllm_dtype("bf16", on_gpu=False) == "bfloat16"
    ve.check_device_memory(0.5, free_bytes=60 << 30, total_bytes=100 << 30)
    with pytest.raises(ValueError, match=r"asks for 70.00 GiB .* 100.00 GiB, but only 40.00 GiB is free"):
        ve.check_device_memory(0.7, free_bytes=40 << 30, total_bytes=100 << 30)
    with pytest.raises(ValueError, match="head_dim 16 .* rollout.engine=hf"):
        ve.check_cpu_head_dim(16, "/m")


def test_to_rollout_rejects_aborted():
    with pytest.raises(RuntimeError, match="abort"):
        ve.to_rollout([1], SimpleNamespace(token_ids=[3], logprobs=None, finish_reason="abort"), False)


@needs_vllm
def test_routed_experts_become_the_rollouts_routes():
    """vLLM's CompletionOutput.routed_experts [prompt + response - 1, layers, k] (uint8 for <= 256 experts)
    -> Rollout.routed_experts, [tokens, layers x k] in that order, one byte an expert, as the HF engine
    gives them; a count that is not the tokens fed is refused (what the trainer would replay misaligned)."""
    import numpy as np
    from vllm.outputs import CompletionOutput

    routes = np.arange(4 * 2 * 3, dtype=np.uint8).reshape(4, 2, 3) % 8  # prompt 2 + response 3 - 1 tokens
    out = CompletionOutput(index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None, logprobs=None,
                           routed_experts=routes, finish_reason="stop")
    rollout = ve.to_rollout([1, 2], out, False, routes=True)
    assert rollout.routed_experts.experts.dtype == np.uint8
    assert rollout.routed_experts.experts.reshape(-1).tolist() == routes.reshape(-1).tolist()
    assert ve.to_rollout([1, 2], out, False).routed_experts is None  # not asked for: none kept
    short = CompletionOutput(index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None, logprobs=None,
                             routed_experts=routes[:3], finish_reason="stop")
    with pytest.raises(RuntimeError, match="routed experts for 3 tokens, not the 4 it was fed"):
        ve.to_rollout([1, 2], short, False, routes=True)


def test_routing_replay_with_vllm_on_cpu_is_refused_before_anything_is_built():
    cfg = dataclasses.replace(tiny_cfg(), moe=MoEConfig(router_replay="R3"))
    with pytest.raises(ConfigError, match="moe.router_replay=R3 with rollout.engine=vllm needs CUDA"):
        ve.VLLMEngine.preflight(EngineSpec.of(cfg, model_path="unused"))


def test_missing_vllm_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    assert get_engine_cls("vllm") is ve.VLLMEngine  # importing the module does not need vllm
    with pytest.raises(ImportError, match=r"\./install\.sh vllm.*container.*rollout\.engine=hf"):
        ve.VLLMEngine("unused", mode="standalone", kv_cache_memory_bytes=1 << 20)


def test_from_spec_refuses_inexact_logprobs():
    cfg = tiny_cfg(temperature=0.8, top_p=0.9)
    with pytest.raises(ValueError, match="check_logprob_mismatch"):
        ve.VLLMEngine.from_spec(EngineSpec.of(cfg, model_path="unused"))


@needs_vllm
def test_colocated_needs_torch_distributed(monkeypatch):
    # (The in-process engines below start a one-process world of their own: pretend there is none.)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="runs under torchrun: initialise torch.distributed first"):
        ve.VLLMEngine.from_spec(EngineSpec.of(tiny_cfg(), model_path="unused"))


# ---------------------------------------------------------------- the real engine
def tiny_qwen2(seed: int, tied: bool) -> "torch.nn.Module":
    """A random Qwen2 vLLM's CPU attention can run: head_dim 32 (64 / 2 heads), GQA (1 KV head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=tied, eos_token_id=EOS, bos_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init: peaked distributions, top-p bites
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.float().eval()


def tiny_cfg(**rollout) -> DAPOConfig:
    rollout = {"n": 2, "max_response_length": 48, "kv_cache_memory_mb": KV_MB, **rollout}
    return DAPOConfig(seed=5,
                      data=DataConfig(max_prompt_length=16, prompts_per_step=2, gen_prompts_per_batch=2),
                      rollout=RolloutConfig(**rollout), train=TrainConfig(mini_batch_prompts=1),
                      reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{tied: (checkpoint dir, the HF model saved there)}."""
    out = {}
    for tied in (False, True):
        model = tiny_qwen2(0, tied)
        path = tmp_path_factory.mktemp("tied" if tied else "untied")
        model.save_pretrained(path)
        out[tied] = (str(path), model)
    return out


@pytest.fixture(scope="module")
def engines(models):
    """{tied: engine}: untied from the constructor (raw log-probs, T = 1), tied from from_spec
    (T = 0.7 -> processed log-probs); both load the checkpoint's weights."""
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed (./install.sh vllm installs its CPU build)")
    built = {}
    try:
        built[False] = ve.VLLMEngine(models[False][0], mode="standalone", in_process=True, dtype="float32",
                                     max_model_len=64, seed=0, kv_cache_memory_bytes=KV_MB << 20)
        built[True] = ve.VLLMEngine.from_spec(EngineSpec.of(tiny_cfg(temperature=0.7), model_path=models[True][0]),
                                              mode="standalone", in_process=True)
        yield built
    finally:
        for eng in reversed(list(built.values())):  # the first one started the process group
            eng.shutdown()


def flat(groups):
    return [r for g in groups for r in g]


def max_diff(model, rollouts, temperature) -> float:
    forced = score_logprobs(model, [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                            temperature)
    return max(abs(a - b) for r, f in zip(rollouts, forced) for a, b in zip(r.logprobs, f, strict=True))


@pytest.mark.slow
@needs_vllm
def test_cpu_head_sizes_match_vllm():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == vllm_checks.CPU_HEAD_SIZES


@pytest.mark.slow
@needs_vllm
def test_from_spec_settings(engines):
    eng, cfg = engines[True], tiny_cfg(temperature=0.7)
    model_config = eng.llm.llm_engine.model_config
    assert eng.logprobs_mode == "processed_logprobs" and eng.tied and eng.eos_token_ids == (EOS,)
    assert eng.max_model_len == cfg.data.max_prompt_length + cfg.rollout.max_response_length
    assert model_config.dtype == torch.float32 and model_config.seed == cfg.seed
    assert eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == KV_MB << 20
    assert not eng.enable_sleep_mode and eng.mode == "standalone" and eng.dp_size == 1
    assert eng.sleep_level == cfg.rollout.sleep_level == 2  # the loop's default: every wake follows a full sync
    assert eng.model_runner == "v1"  # vLLM's CPU build; 0.33 on CUDA runs v2 (tests/gpu)
    # Building restored what vLLM changes in this process.
    assert torch.set_num_threads is SET_NUM_THREADS


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_generate_matches_teacher_forced_hf(engines, models, top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=24, seed=1)
    out = engines[False].generate(PROMPTS, n=3, params=params)
    assert [len(g) for g in out] == [3] * len(PROMPTS)
    for group, prompt in zip(out, PROMPTS):
        for r in group:
            assert r.prompt_ids == prompt and 1 <= len(r.response_ids) <= 24
            assert len(r.logprobs) == len(r.response_ids) and all(lp <= 0 for lp in r.logprobs)
            if r.finish_reason == "length":
                assert len(r.response_ids) == 24
            else:
                assert r.response_ids[-1] == EOS and EOS not in r.response_ids[:-1]
    assert max_diff(models[False][1], flat(out), 1.0) < TOL


@pytest.mark.slow
@needs_vllm
def test_processed_logprobs_at_another_temperature(engines, models):
    eng = engines[True]
    out = flat(eng.generate(PROMPTS, n=2, params=SamplingParams(temperature=0.7, max_tokens=24, seed=2)))
    assert max_diff(models[True][1], out, 0.7) < TOL
    with pytest.raises(ValueError, match="processed_logprobs"):  # top-p at T != 1: no exact mode
        eng.generate(PROMPTS, n=1, params=SamplingParams(temperature=0.7, top_p=0.9))
    eng.generate(PROMPTS[:1], n=1,
                 params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2, logprobs=False))


@pytest.mark.slow
@needs_vllm
def test_stop_tokens_end_the_response_and_are_kept(engines):
    """Replay: the same seeds with a token of the free run as a stop id (then as the engine's EOS)
    must give the free run cut right after that token's first occurrence, finish_reason "stop"."""
    eng = engines[False]
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    free = eng.generate(PROMPTS, n=2, params=params)
    at = next((i, k) for i, g in enumerate(free) for k, r in enumerate(g) if r.finish_reason == "length")
    ref = free[at[0]][at[1]].response_ids
    assert len(ref) == 16
    stop = ref[5]
    cut = ref[:ref.index(stop) + 1]
    stopped = eng.generate(PROMPTS, n=2, params=dataclasses.replace(params, stop_token_ids=(stop,)))
    got = stopped[at[0]][at[1]]
    assert got.response_ids == cut and got.finish_reason == "stop" and len(got.logprobs) == len(cut)
    for before, after in zip(flat(free), flat(stopped)):
        n = before.response_ids.index(stop) + 1 if stop in before.response_ids else len(before.response_ids)
        assert after.response_ids == before.response_ids[:n]
    eos = eng.eos_token_ids
    try:
        eng.eos_token_ids = (stop,)  # the checkpoint's EOS ids travel the same way, with every request
        again = eng.generate([PROMPTS[at[0]]], n=2, params=params, prompt_indices=[at[0]])
        assert again[0][at[1]].response_ids == cut and again[0][at[1]].finish_reason == "stop"
        # max_model_len caps a response too: 58 prompt tokens + 6 = 64 (no stop ids at all here).
        eng.eos_token_ids = ()
        capped = eng.generate([list(range(2, 60))], n=1, params=params)[0][0]
        assert len(capped.response_ids) == 6 and capped.finish_reason == "length"
    finally:
        eng.eos_token_ids = eos


@pytest.mark.slow
@needs_vllm
def test_per_response_seeds(engines):
    eng = engines[False]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=4)
    batch = [[p % VOCAB + 2, 7, 9] for p in range(6)]
    many = eng.generate(batch, n=2, params=params)
    again = eng.generate(batch, n=2, params=params)
    assert [r.response_ids for r in flat(many)] == [r.response_ids for r in flat(again)]
    one = eng.generate([batch[5]], n=2, params=params, prompt_indices=[5])
    assert [r.response_ids for r in one[0]] == [r.response_ids for r in many[5]]
    for a, b in zip(one[0], many[5]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL
    assert one[0][0].response_ids != one[0][1].response_ids  # sample k has its own stream
    other = eng.generate([batch[5]], n=2, params=params)  # index 0: another stream
    assert [r.response_ids for r in other[0]] != [r.response_ids for r in many[5]]
    with pytest.raises(ValueError, match="1 prompt_indices for 2 prompts"):
        eng.generate(batch[:2], n=1, params=params, prompt_indices=[0])
    # Unseeded: base seeds from the engine's own generator; still valid rollouts.
    assert len(eng.generate(batch[:1], n=2, params=dataclasses.replace(params, seed=None))[0]) == 2


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_update_weights_makes_the_engine_the_new_model(engines, models, tied):
    eng, (_, old) = engines[tied], models[tied]
    temperature = 0.7 if tied else 1.0
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    new = tiny_qwen2(1, tied)
    # Small buckets: q/k/v, weight/bias and gate/up of one layer land in different calls. The
    # state dict of a tied HF model also holds lm_head.weight (= the embedding).
    stats = sync_weights(eng, new.state_dict().items(), bucket_bytes=64 * 128 * 4)
    assert stats["num_buckets"] > 6
    eng.sleep()  # no-op on CPU, as wake_up
    eng.wake_up()
    out = flat(eng.generate(PROMPTS, n=2, params=params))
    assert max_diff(new, out, temperature) < TOL
    assert max_diff(old, out, temperature) > 100 * TOL
    # A partial update (one tensor) leaves the rest as it is.
    norm = new.model.norm.weight.detach() * 1.5
    eng.update_weights([("model.norm.weight", norm)])
    with torch.no_grad():
        new.model.norm.weight.copy_(norm)
    assert max_diff(new, flat(eng.generate(PROMPTS, n=2, params=params)), temperature) < TOL
    # Two syncs back to back, no generate between (each closes its own reload: the second used
    # to feed layers the first had already re-processed), ending on the old weights for the other tests.
    sync_weights(eng, new.state_dict().items(), bucket_bytes=1 << 20)
    sync_weights(eng, old.state_dict().items(), bucket_bytes=1 << 20)
    assert max_diff(old, flat(eng.generate(PROMPTS, n=1, params=params)), temperature) < TOL


@pytest.mark.slow
@needs_vllm
def test_abort_ends_the_running_generate_at_its_next_step_and_every_later_one(engines):
    """abort() from another thread (rollout/separate.py's stop), sent while the engine steps: the
    generate raises GenerationAborted before its next step instead of decoding its 40 tokens (no
    EOS here), and leaves no request in vLLM; a later call raises without a step. The module's
    engine is then made to generate again for the other tests (a stopping rank never does)."""
    eng = engines[False]
    core, steps = eng.llm.llm_engine, []
    real_step = core.step

    def step():
        steps.append(1)
        if len(steps) == 3:  # the prefill and a decode step done
            aborter = threading.Thread(target=eng.abort)
            aborter.start()
            aborter.join()
        return real_step()

    eos, params = eng.eos_token_ids, SamplingParams(temperature=1.0, max_tokens=40, seed=2)
    core.step, eng.eos_token_ids = step, ()
    try:
        with pytest.raises(GenerationAborted):
            eng.generate(PROMPTS, n=2, params=params)
        assert len(steps) == 3, f"the generate went on for {len(steps)} engine steps after the abort"
        assert core.get_num_unfinished_requests() == 0
        with pytest.raises(GenerationAborted):
            eng.generate(PROMPTS, n=2, params=params)
        assert len(steps) == 3
    finally:
        del core.step
        eng.eos_token_ids = eos
        eng._aborted.clear()
    assert [len(r.response_ids) for r in flat(eng.generate(PROMPTS, n=1, params=params))] != []


@pytest.mark.slow
@needs_vllm
def test_a_weight_update_with_requests_still_running_refuses_the_stale_prefix_cache(engines, models):
    """vLLM resets its prefix cache only when no running request holds blocks (its reset returns
    False otherwise), and their KV came from the old weights: the update says so instead of going
    on with the stale cache. A request enqueued and stepped once (prefilled, running) stands for a
    generate still in flight."""
    eng, (_, model) = engines[False], models[False]
    core = eng.llm.llm_engine
    ids = eng.llm.enqueue(prompts=[{"prompt_token_ids": PROMPTS[0]}],
                          sampling_params=[eng._vllm.SamplingParams(max_tokens=30, seed=1)], use_tqdm=False)
    try:
        core.step()
        assert core.get_num_unfinished_requests() == 1
        eng.update_weights(model.state_dict().items())
        with pytest.raises(RuntimeError, match="kept its prefix cache after a weight update"):
            eng.finish_weight_update()
    finally:
        core.abort_request(ids, internal=True)
        while core.has_unfinished_requests():
            core.step()
    assert eng.llm.reset_prefix_cache()  # nothing running: the cache goes
    assert max_diff(model, flat(eng.generate(PROMPTS, n=1, params=SamplingParams(max_tokens=8, seed=5))), 1.0) < TOL


@pytest.mark.slow
@needs_vllm
def test_bad_inputs_fail_clearly(engines, models, tmp_path):
    eng, (_, model) = engines[False], models[False]
    with pytest.raises(ValueError, match="no module or parameter named 'foo'"):
        eng.update_weights([("model.foo.weight", torch.zeros(3))])
    params = SamplingParams(max_tokens=8, seed=6)
    assert max_diff(model, flat(eng.generate(PROMPTS, n=1, params=params)), 1.0) < TOL  # still intact
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens, and the engine's max_model_len is 64"):
        eng.generate([[1], [2] * 64], n=1, params=params)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate([[]], n=1, params=params)
    # Before vLLM builds anything:
    path = models[False][0]
    with pytest.raises(ValueError, match="rollout.kv_cache_memory_mb"):
        ve.VLLMEngine(path, mode="standalone")
    with pytest.raises(ValueError, match="kv_cache_memory_mb"):
        ve.VLLMEngine.from_spec(EngineSpec.of(tiny_cfg(kv_cache_memory_mb=0), model_path=path))
    with pytest.raises(ValueError, match="enable_sleep_mode=True needs CUDA"):
        ve.VLLMEngine(path, mode="standalone", kv_cache_memory_bytes=1 << 20, enable_sleep_mode=True)
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1).save_pretrained(tmp_path)  # config.json only; head_dim 16
    with pytest.raises(ValueError, match="head_dim 16 is not supported by vLLM's CPU attention"):
        ve.VLLMEngine(str(tmp_path), mode="standalone", kv_cache_memory_bytes=1 << 20)


class _RecordingLLM:
    """What VLLMEngine asks of vllm.LLM around a sync (sleep mode is CUDA-only: the real engine
    cannot show it here)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_passes_the_configured_level_and_wakes_in_order(level):
    eng = object.__new__(ve.VLLMEngine)  # the methods under test, without building vLLM
    eng.llm, eng.enable_sleep_mode, eng.sleep_level, eng._asleep, eng._reloading = (
        _RecordingLLM(), True, level, set(), False)
    eng.sleep()
    eng.sleep()  # already asleep: nothing more
    eng.wake_up()
    assert eng.llm.calls == [("sleep", level), ("wake_up", None)]
