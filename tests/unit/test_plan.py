"""memory_plan.py against three references: parameter counts against transformers' own models (and the
published Qwen2.5 sizes), trainer-state bytes against megatron's theoretical_memory_usage.py, and the
plan of a CPU layout against the memory a real Megatron actor takes for one update."""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo import cli
from megatron_dapo.config_loading import load_config
from megatron_dapo.convert.synthetic import QWEN25_CONFIGS
from megatron_dapo.memory_plan import GB, count_parameters, plan

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml"
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


def _megatron_formula():
    """megatron/training/theoretical_memory_usage.py, loaded alone: megatron.training itself does not
    import on Python 3.11 (typing.override), and the formula needs only its arguments."""
    path = Path(importlib.util.find_spec("megatron.core").origin).parents[1] / "training" / "theoretical_memory_usage.py"
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
    args = SimpleNamespace(seq_length=tokens, micro_batch_size=1, hidden_size=5120, ffn_hidden_size=27648, num_layers=64,
                           pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                           tensor_model_parallel_size=8, padded_vocab_size=152064)
    theirs = _megatron_formula().compute_activation_memory(args, num_microbatches=16)
    ours = plan(cfg, hf, 128).parts["activations"]
    assert ours == pytest.approx(theirs, rel=0.01)


def test_the_paper_layout_fits_and_an_oversized_one_is_refused_naming_the_knob(capsys):
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "peak while generating" in out and "of 80 GB per GPU" in out
    assert cli.main([*base, "rollout.gpu_memory_utilization=0.9"]) == 2
    assert "lower rollout.gpu_memory_utilization=0.9" in capsys.readouterr().err
    assert cli.main([*base, "model.recompute=none", "train.max_tokens_per_micro_batch=65536",
                     "rollout.gpu_memory_utilization=0.1"]) == 2
    assert "set model.recompute=full or lower train.max_tokens_per_micro_batch" in capsys.readouterr().err


def test_train_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    args = ["train", "--dry-run", "--config", str(PAPER), "--world-size", "128", "--shape", "32B",
            f"logging.dir={tmp_path / 'run'}"]
    assert cli.main(args) == 0
    assert "per-GPU memory" in capsys.readouterr().out and not (tmp_path / "run").exists()


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # in-process tests may leave them
MEASURE = """
import json, os, resource, sys, psutil, torch
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
batch = [Sample(prompt_ids=torch.randint(0, 1000, (4,), generator=g), response_ids=torch.randint(0, 1000, (4,), generator=g),
                advantages=1.0, old_log_probs=torch.full((4,), -7.0)) for _ in range(8)]
actor.get_loss_and_metrics(batch)
held = psutil.Process().memory_info().rss - before  # what the actor holds after an update
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
p = plan(cfg, hf, 1, on_gpu=False)
print(json.dumps({"held": held, "peak": peak, "state": p.state}))
"""


@pytest.mark.slow
def test_the_cpu_plan_of_trainer_state_matches_a_real_update():
    """fp32 on CPU: weights 4 + gradients 4 + Adam 8 = 16 bytes per parameter; a 130M-parameter model
    (8 x 8-token sequences, so activations are small) takes one real update in a fresh process."""
    hf = dict(TINY, vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, hidden_act="silu")
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(hf), str(ROOT / "conf/cpu_tiny.yaml"),
                          "train.mini_batch_prompts=1", "rollout.n=8", "data.prompts_per_step=16"],
                         capture_output=True, text=True, timeout=600, env={**{k: v for k, v in os.environ.items() if k not in _DIST_ENV}, "MALLOC_ARENA_MAX": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"plan {r['state'] / GB:.3f} GB, held after the update {r['held'] / GB:.3f} GB, peak {r['peak'] / GB:.3f} GB")
    assert r["held"] == pytest.approx(r["state"], rel=0.1)
    # the peak adds a transient copy of the weights while megatron initialises them on the CPU
    assert r["state"] < r["peak"] < r["state"] * 1.35
