"""The memory plan of a mixture-of-experts model (plan_params.py, moe_plan.py) on Qwen3-30B-A3B: its
parameter counts against a count of its tensors written out here and transformers' own model, a rank's
share and trainer state under expert parallelism by hand and against megatron's
theoretical_memory_usage.py (which takes EP and the expert-data-parallel size), the activations, the
dispatcher's buffers, the FLOPs at the active parameters, the expert groups' communicators, the engine's
weights, a save's two gathers, and the recipe's plan."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo import cli
from megatron_dapo.config_loading import load_config
from megatron_dapo.convert.synthetic import SHAPES
from megatron_dapo.gpu_models import MiB
from megatron_dapo.memory_plan import plan
from megatron_dapo.plan_params import count_parameters
from megatron_dapo.save_memory import save_host
from tests.unit.test_plan import _megatron_formula

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "conf/recipes/dapo-qwen3-30b-a3b-math-4n8g-pp2ep8.v1.yaml"
A3B = SHAPES["Qwen3-30B-A3B"]
T = 22528  # base.yaml's train.max_tokens_per_micro_batch

# Qwen3-30B-A3B's tensors, by hand from its config.json (hidden 2048, 32 query heads and 4 KV heads of
# 128, 128 experts of width 768, vocabulary 151936, untied): per layer
ATTENTION = (4096 * 2048 + 512 * 2048 + 512 * 2048 + 2048 * 4096  # q_proj, k_proj, v_proj, o_proj
             + 128 + 128 + 2048 + 2048)  # q_norm, k_norm, input_layernorm, post_attention_layernorm
ROUTER = 128 * 2048  # mlp.gate
EXPERT = 768 * 2048 + 768 * 2048 + 2048 * 768  # one expert's gate_proj, up_proj, down_proj
EMBEDDING = 151936 * 2048  # embed_tokens, and lm_head again
DENSE_LAYER = ATTENTION + ROUTER  # what a rank holds of a layer whatever its EP (at TP 1)


def _recipe(*overrides, world=32, **kw):
    return plan(load_config(RECIPE, list(overrides)), A3B, world, **kw)


def test_qwen3_30b_a3b_counts_its_tensors_and_the_model_card():
    """30.5B parameters, 29.9B without the embeddings; 3.35B active (a token's 8 experts of 128), which
    the card says as 3.3B."""
    total = 48 * (DENSE_LAYER + 128 * EXPERT) + 2 * EMBEDDING + 2048  # + the final norm
    active = 48 * (DENSE_LAYER + 8 * EXPERT) + 2 * EMBEDDING + 2048
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    shard = count_parameters(A3B, tp=1, pp=1, padded_vocab=151936)
    assert (shard.total, shard.active, shard.on_rank) == (total, active, total)
    assert (round(total / 1e9, 1), round((total - 2 * EMBEDDING) / 1e9, 1)) == (30.5, 29.9)
    assert 3.3e9 < active < 3.4e9


def test_a_tiny_qwen3_moe_counts_as_transformers_builds_it():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny))
    hf = {**tiny, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    assert count_parameters(hf, tp=1, pp=1, padded_vocab=128).total == sum(p.numel() for p in model.parameters())


MEGATRON_COUNT = """
import json, sys
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
apply_cpu_compat()
from megatron_dapo.config_loading import load_config
from megatron_dapo.mcore.model import build_model
from megatron_dapo.mcore.parallel import initialize_parallel
hf, cfg = json.loads(sys.argv[1]), load_config(sys.argv[2])
initialize_parallel(hf, parallel=cfg.parallel, model=cfg.model, seed=0)
chunks = build_model(hf, model=cfg.model, parallel=cfg.parallel, on_gpu=False, moe=cfg.moe)
print(json.dumps(sum(p.numel() for c in chunks for p in c.parameters())))
"""


@pytest.mark.slow
def test_a_ranks_share_equals_megatrons_own_model_at_ep_2():
    """conf/cpu_tiny_moe.yaml's EP 2 over 2 CPU processes: each rank's megatron model holds 4 of the 8
    experts of each layer, the attention, norms, router and embeddings whole."""
    hf = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256, hidden_size=64,
              intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, tie_word_embeddings=False,
              rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=1e6, hidden_act="silu", norm_topk_prob=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--no-python", sys.executable, "-c", MEGATRON_COUNT, json.dumps(hf),
                          str(ROOT / "conf/cpu_tiny_moe.yaml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = [json.loads(line) for line in out.stdout.split() if line.isdigit()]
    assert counts == [count_parameters(hf, tp=1, pp=1, padded_vocab=256, ep=2).on_rank] * 2


def test_a_ranks_share_at_ep_8_by_hand():
    """EP 8 gives a rank 16 of the 128 experts of each layer of its stage; the attention, the norms and the
    router stay whole (TP 1). The recipe's TP 1 x PP 2: 24 layers and the embedding on the first stage."""
    one_node = count_parameters(A3B, tp=1, pp=1, padded_vocab=151936, ep=8)
    assert one_node.experts_on_rank == 48 * 16 * EXPERT
    assert one_node.on_rank == 48 * (DENSE_LAYER + 16 * EXPERT) + 2 * EMBEDDING + 2048 == 5_164_972_032
    first_stage = count_parameters(A3B, tp=1, pp=2, padded_vocab=151936, ep=8)
    assert first_stage.on_rank == 24 * (DENSE_LAYER + 16 * EXPERT) + EMBEDDING == 2_582_484_992
    # TP 2 halves the attention and each expert's MLP (megatron's expert TP is TP), not the norms or router
    tp2 = count_parameters(A3B, tp=2, pp=1, padded_vocab=151936, ep=8)
    assert tp2.on_rank == 48 * ((ATTENTION - 4352) / 2 + 4352 + ROUTER + 16 * EXPERT / 2) + EMBEDDING + 2048


@pytest.mark.parametrize("layout", [("1", "2", "8", 32), ("1", "1", "8", 16), ("2", "1", "4", 32)],
                         ids=["recipe_tp1_pp2_ep8", "tp1_ep8_edp2", "tp2_ep4_edp4"])
def test_trainer_state_equals_megatrons_formula_under_expert_parallelism(layout):
    """megatron's compute_weight_and_optimizer_memory splits the experts over ETP x EP and their 12 B of
    master weights and m, v over the expert-data-parallel size, world / (ETP x EP x PP); ETP = TP here.
    It leaves out Qwen3's query/key norms (256 parameters a layer)."""
    tp, pp, ep, world = int(layout[0]), int(layout[1]), int(layout[2]), layout[3]
    args = SimpleNamespace(
        kv_channels=128, num_attention_heads=32, hidden_size=2048, group_query_attention=True, num_query_groups=4,
        num_experts=128, moe_layer_freq=1, moe_ffn_hidden_size=768, swiglu=True, ffn_hidden_size=6144,
        moe_shared_expert_intermediate_size=None, num_layers=48, mtp_num_layers=None, normalization="RMSNorm",
        multi_latent_attention=False, padded_vocab_size=151936, untie_embeddings_and_output_weights=True,
        moe_latent_size=None, add_bias_linear=False, moe_router_topk=8, expert_tensor_parallel_size=tp,
        expert_model_parallel_size=ep, pipeline_model_parallel_size=pp, world_size=world, tensor_model_parallel_size=tp,
        data_parallel_size=world // (tp * pp), use_distributed_optimizer=True)
    theirs = _megatron_formula().compute_weight_and_optimizer_memory(args)
    ours = _recipe(*(f"parallel.{k}={v}" for k, v in (("tensor_model_parallel_size", tp),
                                                      ("pipeline_model_parallel_size", pp),
                                                      ("expert_model_parallel_size", ep))), world=world).state
    assert ours == pytest.approx(theirs, rel=1e-4)


def test_the_optimizer_state_of_the_experts_divides_over_expert_dp_and_the_rest_over_dp():
    """The recipe: DP 16, EP 8, so expert DP 2. Master weights 4 B and m, v 8 B a parameter, the dense
    770.5M over 16 ranks, the rank's 1.81B expert parameters over 2."""
    dense, experts = 24 * DENSE_LAYER + EMBEDDING, 24 * 16 * EXPERT
    parts = _recipe().parts
    assert parts["weights"] == 2 * (dense + experts) and parts["gradients"] == 4 * (dense + experts)
    assert parts["master"] == pytest.approx(4 * (dense / 16 + experts / 2))
    assert parts["adam"] == pytest.approx(8 * (dense / 16 + experts / 2))


def test_activations_and_the_dispatchers_buffers_by_hand():
    """Full recompute, PP 2: the first stage keeps each of its 24 layers' input for 2 micro-batches, and
    rebuilds one layer: megatron's estimate at the active width (8 x 768 = 6144), the 8 dispatched copies
    of each token the experts keep, the router's fp32 logits and scores. The alltoall dispatcher's permuted
    copy and all-to-all output at TP 1; allgather's gathered hidden states, probabilities and routing map
    over TP x EP = 8 ranks and the combine's bf16 and fp32 copies."""
    layer = T * 2048 * (18 + 4 * 6144 / 2048) + T * 8 * 2048 * 2 + 2 * T * 128 * 4
    parts = _recipe().parts
    assert parts["activations"] == pytest.approx(2 * 24 * T * 2048 * 2 + layer)
    assert parts["activations_last"] == pytest.approx(24 * T * 2048 * 2 + layer)
    assert parts["moe_dispatch"] == 2 * T * 8 * 2048 * 2
    gathered = _recipe("moe.token_dispatcher=allgather").parts["moe_dispatch"]
    assert gathered == T * 8 * (2048 * 2 + 128 * 5) + T * 8 * 2048 * 6
    assert _recipe("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                   world=64).parts["moe_dispatch"] == 2 * T * 8 * 2048 * 2 / 2 + T * 8 * 2048 * 6


def test_flops_count_the_active_parameters_and_the_engine_holds_every_expert():
    """Generation: 2 x 3.35B active parameters a token (not 30.5B), 1536 x 16 responses of 10240 tokens,
    over 32 GPUs at 30% of 989 TFLOP/s. The engine's weights: every expert in bf16 over rollout TP 4, the
    norms and the router whole, the vocabulary padded to 64 x 4 (152064)."""
    p = _recipe()
    assert p.generation.flops_s == pytest.approx(2 * 3_353_032_704 * 1536 * 16 * 10240 / (32 * 989e12 * 0.3))
    norms = 4352  # of ATTENTION
    shard = 48 * ((ATTENTION - norms + 128 * EXPERT) / 4 + norms + ROUTER) + 2 * 152064 * 2048 / 4 + 2048
    assert p.rollout.weights == 2 * shard
    assert p.rollout.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_the_expert_groups_communicators():
    """Each a group of its own in megatron (a communicator even over the same ranks): alltoall's TP x EP
    (token counts) and EP (tokens), expert TP when TP > 1; allgather's TP x EP alone; expert DP; the
    router's TP x CP with a load-balancing loss. 688 MiB each, 544 for two ranks (PP, expert DP)."""
    line = _recipe().items[1].label
    assert line.endswith("(world 32, grad norm 32, PP 2, DP 16, DP x CP 16, TP x EP 8, EP 8, expert DP 2)")
    assert _recipe().parts["nccl_trainer"] == (6 * 688 + 2 * 544) * MiB
    tp2 = _recipe("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                  "moe.load_balancing=aux_loss", world=64).items[1].label
    assert tp2.endswith("DP 16, DP x CP 16, TP x EP 16, EP 8, expert TP 2, expert DP 2, router TP x CP 2)")
    gathered = _recipe("moe.token_dispatcher=allgather").items[1].label
    assert gathered.endswith("DP x CP 16, TP x EP 8, expert DP 2)")
    assert "EP" not in plan(load_config(ROOT / "conf/recipes/dapo-qwen3-8b-math-4n8g-tp4.v1.yaml"),
                            SHAPES["Qwen3-8B"], 32).items[1].label  # a dense model has none


def test_a_save_gathers_the_dense_state_over_dp_and_the_experts_over_expert_dp():
    """Two gathers, each save_host's: the dense 770.5M parameters on DP rank 0 of 16, the 1.81B expert
    parameters on expert-DP rank 0 of 2 of each EP rank, whose first 8 (TP x EP) share the first node."""
    dense, experts = 24 * DENSE_LAYER + EMBEDDING, 24 * 16 * EXPERT
    kw = dict(gpus_per_node=8, memory_efficient=True, background=True, weight_bytes=2)
    a, b = save_host(dense, tp=1, dp=16, **kw), save_host(experts, tp=8, dp=2, **kw)
    s = _recipe().save
    assert (s.dp_rank0, s.worst_node, s.written_node, s.gathered_node) == pytest.approx(
        (a.dp_rank0 + b.dp_rank0, a.worst_node + b.worst_node, a.written_node + b.written_node,
         a.gathered_node + b.gathered_node))
    assert s.written_node == pytest.approx(14 * (dense + 8 * experts))  # one dense shard, 8 EP ranks' experts
    assert s.other == pytest.approx(a.other + b.dp_rank0)  # EP ranks 1-7 gather their experts, not the rest


def test_the_recipe_fits_four_nodes_and_one_node_is_refused_naming_ep(capsys):
    base = ["plan", "--config", str(RECIPE), "--shape", "Qwen3-30B-A3B"]
    assert cli.main([*base, "--world-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "TP 1 x PP 2 x CP 1 x DP 16 (EP 8 of it: expert DP 2)" in out and "128 experts (top-8)" in out
    assert "MoE alltoall dispatcher buffers" in out and "FLOPs at the 3.35B active of 30.53B parameters" in out
    assert cli.main([*base, "--world-size", "8", "parallel.pipeline_model_parallel_size=1"]) == 2
    assert "a larger TP x PP (now 1) or EP (now 8)" in capsys.readouterr().err
