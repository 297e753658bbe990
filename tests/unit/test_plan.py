"""memory_plan.py against three references: parameter counts against transformers' own models (and the
published Qwen2.5 sizes), trainer-state bytes against megatron's theoretical_memory_usage.py, and the
plan of a CPU layout against the memory a real Megatron actor takes for one update. Then every other
term against its own formula worked out here by hand (the device table, vLLM's share, the CUDA
context and NCCL lines, the output layer's buffers, the KV cache, offload and sleep, the decode
model and which bound binds), and README's generated table. The refusals: tests/unit/test_plan_checks.py."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo import cli
from megatron_dapo.config_loading import load_config
from megatron_dapo.convert.synthetic import QWEN3_CONFIGS, QWEN25_CONFIGS
from megatron_dapo.generation_model import (
    DecodeEstimate,
    GenerationTime,
    Replica,
    decode_estimate,
    kv_bytes_per_token,
)
from megatron_dapo.gpu_models import GPU_MODELS
from megatron_dapo.memory_plan import GB, count_parameters, plan
from megatron_dapo.save_memory import save_host
from megatron_dapo.plan_report import README_BEGIN, readme_block, readme_table

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml"
README = ROOT / "README.md"
TINY = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def test_parameter_counts_equal_transformers_and_the_published_sizes():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # by hand: per layer q 64x64 + k, v 2 x 64x32 + biases 128 + o 64x64 + MLP 3 x 64x128 + 2 norms = 37120
    assert count_parameters(TINY, tp=1, pp=1, padded_vocab=128).total == 2 * 37120 + 64 + 2 * 128 * 64
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in TINY.items() if k != "model_type"}))
    assert count_parameters(TINY, tp=1, pp=1, padded_vocab=128).total == sum(p.numel() for p in model.parameters())
    published = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "7B": 7_615_616_512, "32B": 32_763_876_352}
    assert {k: count_parameters(c, tp=1, pp=1, padded_vocab=c["vocab_size"]).total
            for k, c in QWEN25_CONFIGS.items()} == published


def test_qwen3_parameter_counts_equal_transformers_and_the_model_cards():
    """Qwen3 dense: no biases, per-head query/key norms, 128-wide heads whatever the width (Qwen3-32B:
    64 x 128 = 8192 query rows over 5120). The model cards' sizes, total and non-embedding, in billions."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = {**TINY, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 24}
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in tiny.items() if k != "model_type"}))
    assert count_parameters(tiny, tp=1, pp=1, padded_vocab=128).total == sum(p.numel() for p in model.parameters())
    cards = {"Qwen3-0.6B": (0.6, 0.44), "Qwen3-1.7B": (1.7, 1.4), "Qwen3-4B": (4.0, 3.6), "Qwen3-8B": (8.2, 6.95),
             "Qwen3-14B": (14.8, 13.2), "Qwen3-32B": (32.8, 31.2)}
    for name, (total, non_embedding) in cards.items():
        c = QWEN3_CONFIGS[name]
        count = count_parameters(c, tp=1, pp=1, padded_vocab=c["vocab_size"]).total
        embedding = c["vocab_size"] * c["hidden_size"] * (1 if c["tie_word_embeddings"] else 2)
        digits = len(str(non_embedding).split(".")[1])
        assert (round(count / 1e9, 1), round((count - embedding) / 1e9, digits)) == (total, non_embedding), name


def _megatron_formula():
    """megatron/training/theoretical_memory_usage.py, loaded alone: megatron.training itself does not
    import on Python 3.11 (typing.override), and the formula needs only its arguments."""
    path = (Path(importlib.util.find_spec("megatron.core").origin).parents[1] / "training"
            / "theoretical_memory_usage.py")
    saved = {k: sys.modules.get(k) for k in ("_mt", "_mt.utils")}
    pkg, utils = types.ModuleType("_mt"), types.ModuleType("_mt.utils")
    pkg.__path__ = []
    utils.is_hybrid_model, utils.print_rank_0 = (lambda *a, **k: False), print
    sys.modules.update({"_mt": pkg, "_mt.utils": utils})
    try:
        spec = importlib.util.spec_from_file_location("_mt.theoretical_memory_usage", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    return module


@pytest.mark.parametrize("distributed", [True, False])
def test_trainer_state_equals_megatrons_formula_for_the_paper_layout(distributed):
    hf = QWEN25_CONFIGS["32B"]
    args = SimpleNamespace(
        kv_channels=128, num_attention_heads=40, hidden_size=5120, group_query_attention=True, num_query_groups=8,
        num_experts=None, swiglu=True, ffn_hidden_size=27648, moe_shared_expert_intermediate_size=None, num_layers=64,
        mtp_num_layers=None, normalization="RMSNorm", multi_latent_attention=False, padded_vocab_size=152064,
        untie_embeddings_and_output_weights=True, moe_latent_size=None, add_bias_linear=False, moe_router_topk=None,
        expert_tensor_parallel_size=1, expert_model_parallel_size=1, pipeline_model_parallel_size=2, world_size=128,
        tensor_model_parallel_size=8, data_parallel_size=8, use_distributed_optimizer=distributed)
    theirs = _megatron_formula().compute_weight_and_optimizer_memory(args)
    cfg = load_config(PAPER, [f"parallel.use_distributed_optimizer={str(distributed).lower()}"])
    ours = plan(cfg, hf, 128).state
    assert ours == pytest.approx(theirs, rel=1e-3)  # megatron's formula leaves out the QKV biases


def test_activations_equal_megatrons_formula_with_selective_recompute():
    """megatron's compute_activation_memory (sequence parallel, selective recompute) at the paper's
    layout with our token budget as its sequence: the same per-layer term, every layer's worth in
    flight on the first stage; megatron adds small embedding-side terms."""
    hf = QWEN25_CONFIGS["32B"]
    cfg = load_config(PAPER, ["model.recompute=selective"])
    tokens = cfg.train.max_tokens_per_micro_batch
    args = SimpleNamespace(seq_length=tokens, micro_batch_size=1, hidden_size=5120, ffn_hidden_size=27648,
                           num_layers=64, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                           tensor_model_parallel_size=8, padded_vocab_size=152064)
    theirs = _megatron_formula().compute_activation_memory(args, num_microbatches=16)
    ours = plan(cfg, hf, 128).parts["activations"]
    assert ours == pytest.approx(theirs, rel=0.01)


def test_context_parallel_halves_a_ranks_activations_and_shards_the_state_over_dp_x_cp():
    """CP 2 at the same 128 GPUs: each rank computes half of every micro-batch's positions (megatron's
    formula at half the sequence), and the distributed optimizer shards over DP x CP (megatron's
    intra_dp_cp group; tests/distributed/test_policy_cp.py measures it), so DP 4 x CP 2 keeps the state
    DP 8 x CP 1 keeps; the CP group adds a communicator."""
    hf = QWEN25_CONFIGS["32B"]
    one = plan(load_config(PAPER, ["model.recompute=selective"]), hf, 128)
    two = plan(load_config(PAPER, ["model.recompute=selective", "parallel.context_parallel_size=2"]), hf, 128)
    cfg = load_config(PAPER, ["model.recompute=selective"])
    args = SimpleNamespace(seq_length=cfg.train.max_tokens_per_micro_batch // 2, micro_batch_size=1, hidden_size=5120,
                           ffn_hidden_size=27648, num_layers=64, pipeline_model_parallel_size=2,
                           virtual_pipeline_model_parallel_size=None, tensor_model_parallel_size=8,
                           padded_vocab_size=152064)
    theirs = _megatron_formula().compute_activation_memory(args, num_microbatches=16)
    assert two.parts["activations"] == pytest.approx(theirs, rel=0.01)
    assert two.parts["activations"] == pytest.approx(one.parts["activations"] / 2)
    assert two.state == pytest.approx(one.state)
    assert two.parts["nccl_trainer"] > one.parts["nccl_trainer"]


def test_the_paper_layout_fits_and_an_oversized_one_is_refused_naming_the_knob(capsys):
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "peak while generating" in out and "of 85.06 GB per GPU" in out  # an H100 as CUDA reports it
    assert cli.main([*base, "rollout.gpu_memory_utilization=0.9"]) == 2
    assert "lower rollout.gpu_memory_utilization=0.9" in capsys.readouterr().err
    assert cli.main([*base, "model.recompute=none", "train.max_tokens_per_micro_batch=65536",
                     "rollout.gpu_memory_utilization=0.1"]) == 2
    assert ("set model.recompute=full or lower train.max_tokens_per_micro_batch (down to one sequence, 22528) or "
            "raise parallel.context_parallel_size=1 to 2") in capsys.readouterr().err


def test_separate_placement_plans_the_trainers_ranks_and_refuses_splits_that_cannot_run(capsys):
    sep = ["rollout.engine=hf", "rollout.placement=separate"]
    half = _paper(*sep, "rollout.num_ranks=64")  # 64 trainers: DP 4 where the whole world gives DP 8
    whole = _paper()
    assert half.parts["adam"] == pytest.approx(2 * whole.parts["adam"])  # the optimizer state over DP 4, not 8
    assert any("64 training GPUs" in n for n in half.notes)
    # the recipe's vLLM, on GPUs of its own
    engines_apart = _paper("rollout.placement=separate", "rollout.num_ranks=64")
    assert engines_apart.rollout is None and "vllm_generating" not in engines_apart.parts
    assert engines_apart.parts == {**half.parts}  # the trainers' GPUs hold the same, whatever the engine
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B", *sep]
    assert cli.main([*base, "rollout.num_ranks=64"]) == 0
    out = capsys.readouterr().out
    assert "(64 training, the last 64 holding only engines): TP 8 x PP 2 x CP 1 x DP 4" in out
    assert "16 engine replica(s) of rollout TP 4" in out and "transfer 65" in out
    for ranks, says in (("120", "its first 8 ranks training; rollout.num_ranks=120 hold the engines): world size 8 "
                                "is not divisible by TP x PP x CP"),
                        ("128", "rollout.num_ranks=128 with 128 ranks leaves 0 to train"),
                        ("62", "rollout.num_ranks=62 is not a multiple of rollout.tensor_parallel_size=4")):
        assert cli.main([*base, f"rollout.num_ranks={ranks}"]) == 2
        assert says in capsys.readouterr().err


def test_separate_placement_plans_the_engines_weight_stream_and_refuses_a_wait_shorter_than_two_steps(capsys):
    """The engine ranks hold one bucket of a weight stream (on the device), never a host copy; every
    rank's wait for the other side (rollout.wait_timeout_minutes) must cover twice the planned step."""
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B", "rollout.placement=separate",
            "rollout.num_ranks=64"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    step = float(out.split("per step (generation")[0].rsplit("~", 1)[1].split()[0])  # "~41.0 min per step"
    assert "0.54 GB of device memory besides vLLM's share (rollout.weight_sync_bucket_mb=512), no copy in host" in out
    need = math.ceil(2 * step)
    assert cli.main([*base, f"rollout.wait_timeout_minutes={need + 1}"]) == 0
    capsys.readouterr()
    assert cli.main([*base, f"rollout.wait_timeout_minutes={need - 2}"]) == 2
    assert f"rollout.wait_timeout_minutes={need - 2} is less than twice the planned step" in capsys.readouterr().err
    assert cli.main(["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B",
                     "rollout.wait_timeout_minutes=1"]) == 0  # colocated: nobody waits for another side


def test_train_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    args = ["train", "--dry-run", "--config", str(PAPER), "--world-size", "128", "--shape", "32B",
            f"logging.dir={tmp_path / 'run'}"]
    assert cli.main(args) == 0
    assert "per-GPU memory" in capsys.readouterr().out and not (tmp_path / "run").exists()


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # in-process tests may leave them
MEASURE = """
import ctypes, gc, json, os, resource, sys, psutil, torch
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
apply_cpu_compat()
from megatron_dapo.config_loading import load_config
from megatron_dapo.memory_plan import plan
from megatron_dapo.mcore.actor import MegatronActor
from megatron_dapo.batching import Sample
from megatron_dapo.mcore.parallel import initialize_parallel
hf = json.loads(sys.argv[1]); cfg = load_config(sys.argv[2], sys.argv[3:])
initialize_parallel(hf, parallel=cfg.parallel, model=cfg.model, seed=0)
import megatron.core.optimizer  # everything imported before the baseline
before = psutil.Process().memory_info().rss
actor = MegatronActor(cfg, hf, initialize=False)
g = torch.Generator().manual_seed(0)
batch = [Sample(prompt_ids=torch.randint(0, 1000, (4,), generator=g),
                response_ids=torch.randint(0, 1000, (4,), generator=g),
                advantages=1.0, old_log_probs=torch.full((4,), -7.0)) for _ in range(8)]
actor.get_loss_and_metrics(batch)
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: RSS is then what is alive
held = psutil.Process().memory_info().rss - before  # what the actor holds after an update
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
p = plan(cfg, hf, 1, on_gpu=False)
print(json.dumps({"held": held, "peak": peak, "state": p.state}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    dict(vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8),
    dict(vocab_size=32768, hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4),
], ids=["130M_wide", "69M_deep_vocab"])
def test_the_cpu_plan_of_trainer_state_matches_a_real_update(shape):
    """fp32 on CPU: weights 4 + gradients 4 + Adam 8 = 16 bytes per parameter; a 130M-parameter model
    and a deeper one with a larger share in the vocabulary (8 x 8-token sequences, so activations are
    small) each take one real update in a fresh process."""
    hf = dict(TINY, **shape, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, hidden_act="silu")
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(hf), str(ROOT / "conf/cpu_tiny.yaml"),
                          "train.mini_batch_prompts=1", "rollout.n=8", "data.prompts_per_step=16"],
                         capture_output=True, text=True, timeout=600,
                         env={**{k: v for k, v in os.environ.items() if k not in _DIST_ENV}, "MALLOC_ARENA_MAX": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"plan {r['state'] / GB:.3f} GB, held after the update {r['held'] / GB:.3f} GB, peak {r['peak'] / GB:.3f} GB")
    assert r["held"] == pytest.approx(r["state"], rel=0.1)
    # the peak adds a transient copy of the weights while megatron initialises them on the CPU
    assert r["state"] < r["peak"] < r["state"] * 1.35


# -- the terms beyond the trainer state, each against its formula by hand ---------------------------

GIB, MIB = 2**30, 2**20
QWEN32 = QWEN25_CONFIGS["32B"]


def _paper(*overrides, gpu="h100", **kw):
    return plan(load_config(PAPER, list(overrides)), QWEN32, 128, gpu=gpu, **kw)


def test_the_device_table_holds_what_cuda_reports_between_the_marketed_size_and_nvidia_smi():
    """cudaMemGetInfo's total sits above the marketed GB and below nvidia-smi's memory.total
    (H100 81559 MiB, H200 143771 MiB), whose difference the driver reserves."""
    h100, h200 = GPU_MODELS["h100"], GPU_MODELS["h200"]
    assert h100.reported_bytes == round(79.22 * GIB) and h200.reported_bytes == round(139.80 * GIB)
    assert 80e9 < h100.reported_bytes < 81559 * MIB and 141e9 < h200.reported_bytes < 143771 * MIB
    assert (h100.hbm_bytes_per_s, h200.hbm_bytes_per_s) == (3.35e12, 4.8e12)


def test_vllms_share_is_the_utilization_of_the_reported_total_and_the_override_wins():
    assert _paper().parts["vllm_generating"] == pytest.approx(0.7 * 79.22 * GIB)  # 59.54 GB, not 0.7 x 80
    assert _paper(gpu="h200").parts["vllm_generating"] == pytest.approx(0.7 * 139.80 * GIB)
    given = _paper(gpu="h200", capacity_gb=100)
    assert given.parts["vllm_generating"] == pytest.approx(0.7 * 100e9) and given.capacity_bytes == 100e9
    assert given.gpu.hbm_bytes_per_s == 4.8e12  # --gpu-memory-gb replaces the memory only


def test_context_and_nccl_lines_count_one_communicator_per_group_at_the_paper_layout():
    """TP 8 x PP 2 x DP 8 over 128 ranks: the trainer's world and gradient-norm groups (128), TP 8,
    PP 2, DP 8 and DP x CP 8; vLLM's TP 4 and DP 32 (32 replicas). 544 MiB for a group of two,
    688 MiB for larger ones (NVIDIA/nccl#964)."""
    parts = _paper().parts
    assert parts["context"] == 300 * MIB
    assert parts["nccl_trainer"] == (5 * 688 + 544) * MIB
    assert parts["nccl_vllm"] == 2 * 688 * MIB
    cpu = plan(load_config(PAPER, []), QWEN32, 128, on_gpu=False).parts
    assert cpu["nccl_trainer"] == cpu["context"] == 0  # no CUDA, no NCCL


def test_the_output_layers_buffers_kept_from_forward_to_backward():
    """logprobs.py at V_local = 152064 / 8 = 19008, N = 22528 tokens, H = 5120, bf16: chunks of 256
    tokens (160 MiB / (4 x 19008) = 2206 > 256) of bf16 logits and two fp32 work buffers; early
    gradients [N, H] bf16 for the hidden states, its [N, H] reordered input copy, [V_local, H] fp32."""
    parts = _paper().parts
    assert parts["logprob_buffers"] == 256 * 19008 * (2 + 4 + 4)
    assert parts["early_grads"] == 2 * 22528 * 5120 * 2 + 19008 * 5120 * 4 + 22528 * 4
    p = _paper()
    assert p.training_bytes_on("last") - p.training_bytes_on("first") == pytest.approx(
        parts["logprob_buffers"] + parts["early_grads"] + parts["activations_last"] - parts["activations"])


def test_a_set_chunk_size_is_planned_without_the_byte_cap():
    """train.logprob_chunk_tokens is used as it is (logprobs.py caps only its own default): 8192
    tokens of a 19008-wide shard are 8192 x 19008 x (2 + 4 + 4) B, ~1.56 GB, not the default's 48 MB."""
    parts = _paper("train.logprob_chunk_tokens=8192").parts
    assert parts["logprob_buffers"] == 8192 * 19008 * (2 + 4 + 4)


def test_kv_bytes_per_token_and_the_kv_cache_of_a_qwen25_32b_replica_by_hand():
    """2 (K, V) x 64 layers x 8 KV heads x 128 head_dim x 2 B = 262,144 B a token, 65,536 on each GPU
    at rollout TP 4. The engine's weights are the published 32,763,876,352 parameters x 2 B / 4 (the
    replicated norms add 0.01%); its profile peak is the sampler's 1024 x 152064 fp32 logits twice."""
    r = _paper().rollout
    assert kv_bytes_per_token(QWEN32) == 2 * 64 * 8 * 128 * 2 == 262_144
    assert r.kv_bytes_per_token_per_gpu == 65_536
    assert r.weights == pytest.approx(32_763_876_352 * 2 / 4, rel=1e-3)
    assert r.activations == max(16384 * 3 * 27648 / 4 * 2, 1024 * 152064 * 4 * 2)
    assert r.kv == pytest.approx(0.7 * 79.22 * GIB - r.weights - r.activations)
    assert r.tokens(r.kv) == pytest.approx(r.kv / 65_536)


def test_offload_lowers_the_generating_peak_by_exactly_the_state_that_moved(capsys):
    """actor.offload_during_rollout: gradients (4 B), master weights and m, v (12 B / DP 8) per
    parameter of the rank leave while generating; actor.offload_weights adds the 2 B weights. The KV
    cache gained is that many bytes at 65,536 B per token per GPU; pinned host memory holds what was
    copied (mcore/offload.py releases the gradients without a copy)."""
    base = _paper()
    params = base.parts["weights"] / 2  # bf16
    moved = params * (4 + 12 / 8)
    on = _paper("actor.offload_during_rollout=true")
    assert base.generating_bytes - on.generating_bytes == pytest.approx(moved)
    assert on.rollout.offload == pytest.approx(moved) == base.rollout.offload
    assert on.training_bytes == base.training_bytes  # everything is back before the log-probs
    assert on.host_offload_per_rank == pytest.approx(params * 12 / 8) and base.host_offload_per_rank == 0
    assert on.rollout.tokens(on.rollout.room + on.rollout.offload) - on.rollout.tokens(on.rollout.room) == (
        pytest.approx(moved / 65_536))
    both = _paper("actor.offload_during_rollout=true", "actor.offload_weights=true")
    assert base.generating_bytes - both.generating_bytes == pytest.approx(params * (2 + 4 + 12 / 8))
    assert cli.main(["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B",
                     "actor.offload_during_rollout=true"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "KV cache gained by offload" in x)
    gained = f"KV cache gained by offload: {moved / 1e9:.2f} GB = {moved / 65_536:,.0f} tokens per replica"
    assert line.strip() == gained


def test_sleep_level_1_keeps_the_replicas_weight_shard_in_host_memory_level_2_none(capsys):
    level1 = _paper("rollout.sleep_level=1")
    assert level1.host_sleep_per_rank == pytest.approx(32_763_876_352 * 2 / 4, rel=1e-3)  # 16.4 GB per rank
    assert _paper("rollout.sleep_level=2").host_sleep_per_rank == 0
    assert level1.parts["vllm_asleep"] == _paper().parts["vllm_asleep"] == 1e9  # the GPU residue stays
    assert cli.main(["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B",
                     "rollout.sleep_level=1", "--gpus-per-node", "4"]) == 0
    per_node = 4 * level1.host_sleep_per_rank / 1e9
    assert f"{per_node:.1f} GB per node of 4" in capsys.readouterr().out


def test_a_saves_host_memory_by_hand_at_the_paper_layout(capsys):
    """12 B/param (fp32 master, m, v) of the rank's TP x PP shard: gathered on DP rank 0 with one DDP
    bucket (40M params) of receive buffers and its own 1/DP slice of that bucket (megatron makes the
    slices bucket by bucket); with memory_efficient_save the other DP ranks hold only that slice; a
    resume builds the whole shard's state beside it on every rank (docs/checkpoints_memory.md measured
    each on CPU, with one bucket). TP 8 fills a node, so one node holds 8 DP-rank-0 ranks."""
    shard = count_parameters(QWEN25_CONFIGS["32B"], tp=8, pp=2, padded_vocab=152064).on_rank
    own = 12 * 40e6 / 8
    rank0 = 12 * shard + own + 12 * 40e6
    on = _paper().save
    assert (on.dp_rank0, on.other, on.worst_node, on.resume) == pytest.approx((rank0, own, 8 * rank0,
                                                                                12 * shard + own))
    # one bucket (a shard under 40M params, as on the CPU): the slice is 1/DP of the whole shard
    small = save_host(30e6, tp=1, dp=2, gpus_per_node=8, memory_efficient=True)
    assert (small.dp_rank0, small.other, small.resume) == pytest.approx((12 * 30e6 * 2.5, 12 * 30e6 / 2,
                                                                         12 * 30e6 * 1.5))
    # the recipe's background write holds the gathered state and the bf16 weights' host copy until written
    one_phase = _paper("checkpoint.async_save=false").save
    assert (on.background, on.background_node, one_phase.background) == pytest.approx((14 * shard, 8 * 14 * shard, 0))
    # a stop's warning: the step's updates and a save (8 ranks' 14 B a param written at 2 GB/s, their
    # 12 B a param gathered from 7 of 8 DP ranks at 10 GB/s)
    paper = _paper()
    assert paper.stop_lead_s == pytest.approx(paper.step_s - paper.generation.seconds + 8 * 14 * shard / 2e9
                                              + 8 * 12 * shard * 7 / 8 / 10e9)
    off = _paper("checkpoint.memory_efficient_save=false").save
    assert off.other == off.dp_rank0 == pytest.approx(rank0)
    assert _paper("parallel.use_distributed_optimizer=false").save is None
    tp2 = plan(load_config(PAPER, ["parallel.tensor_model_parallel_size=2"]), QWEN25_CONFIGS["32B"], 128).save
    assert tp2.worst_node == pytest.approx(2 * tp2.dp_rank0 + 6 * tp2.other)  # 2 ranks of DP index 0 per node
    assert cli.main(["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B"]) == 0
    assert f"{rank0 / 1e9:.2f} GB on a DP-rank-0 rank, {own / 1e9:.2f} GB on the others" in \
        capsys.readouterr().out


def test_vllms_startup_check_sees_what_the_offload_moved_before_the_engine_is_built():
    """run.py offloads before it builds the engine: at the check the device holds the context, the
    communicators and what stays (the weights); without offload also the gradients and master weights
    (and, on a resume, m and v). At 0.88 the offloaded layout passes where the resident one fails."""
    on = _paper("actor.offload_during_rollout=true", "rollout.gpu_memory_utilization=0.88")
    off = _paper("rollout.gpu_memory_utilization=0.88")
    parts = off.parts
    base = parts["context"] + parts["nccl_trainer"] + parts["nccl_vllm"]
    share = math.ceil(0.88 * GPU_MODELS["h100"].reported_bytes)
    assert on.startup_spare_bytes == pytest.approx(on.capacity_bytes - base - parts["weights"] - share, abs=1)
    assert off.startup_spare_bytes == pytest.approx(
        off.capacity_bytes - base - parts["weights"] - parts["gradients"] - parts["master"] - share, abs=1)
    assert off.resident_at_build(resume=True) == pytest.approx(off.resident_at_build(resume=False) + parts["adam"])
    assert on.resident_at_build(resume=True) == on.resident_at_build(resume=False)  # m, v offloaded too
    assert on.startup_spare_bytes >= 0 > off.startup_spare_bytes


def test_the_decode_model_on_a_small_example_by_hand():
    """10 responses of 200 tokens after 100-token prompts, KV for 1200 tokens: 1200 / 300 = 4 at once.
    A step reads 1 GB of weights and 4 x (100 + 200 / 2) tokens x 100 kB = 80 MB at 50% of 1 TB/s:
    2.16 ms, 4 / 2.16 ms = 1852 tokens/s. 10 = 4 + 4 + 2: three waves, the last at 2 sequences
    (1 GB + 40 MB: 2.08 ms a step): 2 x 200 x 2.16 ms + 200 x 2.08 ms = 1.28 s."""
    r = Replica(responses=10, prompt_tokens=100, response_tokens=200, kv_tokens=1200,
                weight_bytes_per_gpu=1e9, kv_bytes_per_token_per_gpu=1e5, hbm_bytes_per_s=1e12,
                efficiency=0.5)
    d = decode_estimate(r)
    assert (d.concurrency, d.limited_by, d.waves) == (4, "KV cache", 3)
    assert d.step_s == pytest.approx(2.16e-3) and d.tokens_per_s == pytest.approx(4 / 2.16e-3)
    assert d.seconds == pytest.approx(1.28)
    few = decode_estimate(dataclasses.replace(r, responses=3))  # fewer responses than the KV holds
    assert (few.concurrency, few.limited_by, few.waves) == (3, "responses", 1)
    assert decode_estimate(dataclasses.replace(r, kv_tokens=1e9, max_num_seqs=8)).limited_by == "max_num_seqs"
    assert math.isinf(decode_estimate(dataclasses.replace(r, kv_tokens=100)).seconds)  # not one sequence fits


def test_the_larger_estimate_binds_and_the_paper_run_is_bandwidth_bound_on_both_gpus():
    slow = DecodeEstimate(concurrency=4, limited_by="KV cache", step_s=1.0, tokens_per_s=4.0, waves=1,
                          seconds=20.0)
    assert GenerationTime(flops_s=10.0, decode=slow).binds == "HBM bandwidth (decode)"
    assert GenerationTime(flops_s=10.0, decode=slow).seconds == 20.0
    assert GenerationTime(flops_s=30.0, decode=slow).binds == "FLOPs"
    assert GenerationTime(flops_s=30.0, decode=None).binds == "FLOPs"
    for gpu in ("h100", "h200"):
        g = _paper(gpu=gpu).generation
        assert g.binds.startswith("HBM") and g.seconds == g.decode.seconds > g.flops_s
    # the FLOPs bound by hand: 2 x 32.76B x (1536 x 16 responses x 10240 tokens) at 30% of 989 TFLOP/s x 128
    flops_s = 2 * 32_763_876_352 * 1536 * 16 * 10240 / (128 * 989e12 * 0.3)
    assert _paper().generation.flops_s == pytest.approx(flops_s)


def test_readme_memory_table_is_the_generated_one():
    block = readme_block(README.read_text())
    assert block is not None, f"README.md has lost its {README_BEGIN!r} block"
    assert block == readme_table(ROOT), ("README.md's memory table drifted from the plan: regenerate it with "
                                        "`.venv/bin/python -m megatron_dapo.plan_report --write README.md`")
