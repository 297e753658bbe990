"""The vLLM rollout engine on a real GPU: what the CPU tests cannot check.

tests/unit/test_rollout_vllm_engine.py (the real engine, vLLM's CPU build) covers the contract:
token ids, log-probs against teacher-forced HF, finish reasons, per-response seeds, weight updates
(tied and untied, bucketed), bad inputs; tests/distributed/test_vllm_colocated.py covers colocated
engines against the Megatron actor. Here: bf16 numerics, sleep mode really releasing device memory,
weight sync while asleep, the device-memory check, and colocated (torchrun, NCCL) sleep/sync.

Skipped without CUDA (tests/conftest.py) or without vllm. A tiny random Qwen2 (head_dim 64) is saved
as a bf16 checkpoint; the reference is the same checkpoint in HF transformers, fp32, teacher-forced
(weight_sync.score_logprobs). vLLM computes in bf16, so agreement is checked with the DESIGN metric
(mean exp|diff|) and a loose maximum.
"""

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

vllm = pytest.importorskip("vllm")

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from megatron_dapo.rollout import SamplingParams, logprob_mismatch, score_logprobs, sync_weights  # noqa: E402
from megatron_dapo.rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.gpu

EOS = 1
PROMPTS = [[5, 17, 42, 8], [7, 9], [100, 101, 102, 103, 104, 105, 106], [3]]
MISMATCH_TOL = 1.03  # NeMo-RL's guide: token_mult_prob_error within 1-2% of 1.0 in bf16
UTILIZATION = 0.25


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # peaked next-token distributions so top-p truncates something
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_qwen2(0).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_reference(path_or_model) -> Qwen2ForCausalLM:
    model = (Qwen2ForCausalLM.from_pretrained(path_or_model, dtype=torch.float32)
             if isinstance(path_or_model, str) else path_or_model)
    return model.float().cuda().eval()


def check_against(model, rollouts, temperature: float) -> dict:
    """Teacher-forced mismatch metrics of rollouts' log-probs against an HF model."""
    forced = score_logprobs(model, [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                            temperature)
    width = max(len(r.response_ids) for r in rollouts)
    eng = torch.zeros(len(rollouts), width)
    ref = torch.zeros_like(eng)
    mask = torch.zeros_like(eng)
    for b, (r, f) in enumerate(zip(rollouts, forced)):
        eng[b, :len(f)], ref[b, :len(f)], mask[b, :len(f)] = torch.tensor(r.logprobs), torch.tensor(f), 1
    return {k: v.item() for k, v in logprob_mismatch(eng, ref, mask).items()}


def free_bytes() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]  # device-wide: counts the engine's worker process too


@pytest.fixture(scope="module")
def engine(ckpt_dir):
    """Standalone, engine core in a child process (weight updates pickled across vLLM's RPC)."""
    eng = VLLMEngine(ckpt_dir, mode="standalone", gpu_memory_utilization=UTILIZATION, max_model_len=512,
                     dtype="bfloat16", seed=0, logprobs_mode="raw_logprobs")
    assert eng.enable_sleep_mode  # on by default with CUDA
    yield eng
    eng.shutdown()
    free_bytes()


def flat(groups):
    return [r for g in groups for r in g]


@pytest.mark.parametrize("top_p,top_k", [(1.0, -1), (0.7, -1), (0.9, 20)])
def test_bf16_logprobs_match_teacher_forced_hf(engine, ckpt_dir, top_p, top_k):
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, max_tokens=32, seed=1)
    rollouts = flat(engine.generate(PROMPTS, n=4, params=params))
    m = check_against(hf_reference(ckpt_dir), rollouts, 1.0)
    assert m["rollout/logprob_mismatch"] < MISMATCH_TOL, m
    assert m["rollout/logprob_abs_diff_max"] < 0.25, m


def test_sleep_releases_device_memory(engine, ckpt_dir):
    total = torch.cuda.mem_get_info()[1]
    awake = free_bytes()
    engine.sleep()
    asleep = free_bytes()
    # Weights (level 1: to host memory) and the whole KV cache: most of what the engine took.
    assert asleep - awake > 0.5 * UTILIZATION * total, (awake, asleep, total)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(PROMPTS, n=1, params=SamplingParams(max_tokens=4, seed=0))
    engine.wake_up()
    assert awake - free_bytes() > 0.5 * UTILIZATION * total
    # The weights came back from host memory intact: the checkpoint's log-probs, as before sleeping.
    rollouts = flat(engine.generate(PROMPTS, n=2, params=SamplingParams(max_tokens=16, seed=0)))
    assert len(rollouts) == 8
    m = check_against(hf_reference(ckpt_dir), rollouts, 1.0)
    assert m["rollout/logprob_mismatch"] < MISMATCH_TOL, m
    assert m["rollout/logprob_abs_diff_max"] < 0.25, m


def test_weight_sync_through_sleep_changes_outputs_to_the_new_model(engine, ckpt_dir):
    params = SamplingParams(temperature=1.0, max_tokens=32, seed=4)
    before = flat(engine.generate(PROMPTS, n=2, params=params))
    new = tiny_qwen2(1).to(torch.bfloat16)  # what the engine will hold (bf16 rounding included)
    engine.sleep()
    asleep = free_bytes()
    stats = sync_weights(engine, new.state_dict().items(), bucket_bytes=256 * 512 * 2)
    assert stats["num_buckets"] > 1
    assert free_bytes() > asleep - 0.5 * UTILIZATION * torch.cuda.mem_get_info()[1]  # KV cache still out
    engine.wake_up()
    after = flat(engine.generate(PROMPTS, n=2, params=params))
    assert [r.response_ids for r in before] != [r.response_ids for r in after]
    m_new = check_against(hf_reference(new), after, 1.0)
    m_old = check_against(hf_reference(ckpt_dir), after, 1.0)
    assert m_new["rollout/logprob_mismatch"] < MISMATCH_TOL, m_new
    assert m_old["rollout/logprob_abs_diff_mean"] > 10 * m_new["rollout/logprob_abs_diff_mean"]
    engine.update_weights(Qwen2ForCausalLM.from_pretrained(ckpt_dir).state_dict().items())  # restore


def test_level_2_sleep_then_a_full_sync_generates_with_the_synced_weights(engine, ckpt_dir):
    """rollout.sleep_level=2 (the loop's default) discards the weights: valid because every wake
    follows a full sync. The synced model must be what generates, nothing left of the discarded one."""
    engine.sleep()  # the module's level-1 engine gives its memory back for this one
    eng = VLLMEngine(ckpt_dir, mode="standalone", gpu_memory_utilization=UTILIZATION, max_model_len=512,
                     dtype="bfloat16", seed=0, logprobs_mode="raw_logprobs", sleep_level=2)
    try:
        assert eng.model_runner in ("v1", "v2")  # which one ran is logged; 0.33 on CUDA: v2
        awake = free_bytes()
        eng.sleep()
        assert free_bytes() - awake > 0.5 * UTILIZATION * torch.cuda.mem_get_info()[1]
        new = tiny_qwen2(2).to(torch.bfloat16)
        sync_weights(eng, new.state_dict().items(), bucket_bytes=256 * 512 * 2)
        eng.wake_up()
        after = flat(eng.generate(PROMPTS, n=2, params=SamplingParams(max_tokens=32, seed=4)))
        m = check_against(hf_reference(new), after, 1.0)
        assert m["rollout/logprob_mismatch"] < MISMATCH_TOL, m
    finally:
        eng.shutdown()
        engine.wake_up()


def test_memory_fraction_that_is_not_free_fails_before_building(engine, ckpt_dir):
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match="gpu_memory_utilization=.* GiB is free now"):
        VLLMEngine(ckpt_dir, mode="standalone", gpu_memory_utilization=min(0.99, free / total + 0.05))


COLOCATED_SCRIPT = textwrap.dedent("""
    import gc, sys, torch, torch.distributed as dist
    from transformers import Qwen2ForCausalLM
    from megatron_dapo.rollout import SamplingParams, score_logprobs, sync_weights
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    eng = VLLMEngine(sys.argv[1], mode="colocated", gpu_memory_utilization=0.2, max_model_len=512,
                     dtype="bfloat16", seed=0, load_format="dummy")
    assert (eng.dp_rank, eng.dp_size) == (0, 1) and eng.enable_sleep_mode
    def free():
        gc.collect(); torch.cuda.empty_cache(); torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    awake = free()
    eng.sleep()
    assert free() - awake > 0.1 * torch.cuda.mem_get_info()[1], "sleep released too little"
    hf = Qwen2ForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda()
    sync_weights(eng, hf.state_dict().items(), bucket_bytes=1 << 18)  # wakes the weights only
    eng.wake_up()
    groups = eng.generate([[5, 6, 7], [9]], n=2, params=SamplingParams(max_tokens=8, seed=0))
    out = [r for g in groups for r in g]
    ref = score_logprobs(hf.float(), [r.prompt_ids for r in out], [r.response_ids for r in out], 1.0)
    worst = max(abs(a - b) for r, f in zip(out, ref) for a, b in zip(r.logprobs, f))
    assert worst < 0.25, worst
    eng.shutdown()
    assert dist.is_initialized()  # the engine's shutdown leaves the trainer's world alone
    dist.barrier()
    print("COLOCATED_OK")
""")


def test_colocated_external_launcher_under_torchrun(ckpt_dir, tmp_path):
    script = tmp_path / "colocated.py"
    script.write_text(COLOCATED_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                           str(script), ckpt_dir], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert "COLOCATED_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
