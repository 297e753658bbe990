"""Building the Megatron Qwen2 model: HF config reading, TransformerConfig mapping, parallel checks,
recompute, and logits parity with transformers' Qwen2ForCausalLM (TP=1, in one process)."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.mcore import (
    build_model, destroy_parallel, hf_arch, padded_vocab_size, transformer_config_from_hf,
    validate_parallel, vocab_parallel_logprobs,
)
from megatron_dapo.mcore.model import resolve_runtime
from tests.helpers.convert import hf_to_megatron_by_hand
from tests.helpers.moe import TINY_MOE
from tests.helpers.policy import tiny_hf_config

MODEL = ModelConfig(make_vocab_size_divisible_by=8)
ONE = ParallelConfig()


def test_hf_arch_reads_every_config_form(tmp_path):
    hf = tiny_hf_config()
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    qwen = transformers.Qwen2Config(**kwargs, rope_theta=1e6)
    legacy = {**hf, "rope_theta": 1e6}  # a transformers 4.x config.json: rope_theta at the top
    del legacy["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    arches = [hf_arch(x) for x in (hf, qwen, legacy, tmp_path, str(tmp_path / "config.json"))]
    assert all(a == arches[0] for a in arches)
    a = arches[0]
    assert (a.num_query_groups, a.kv_channels, a.rope_theta, a.norm_eps) == (2, 16, 1e6, 1e-6)


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"use_sliding_window": True}, "sliding"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"model_type": "llama"}, "unsupported architecture <model_type 'llama'>"),
])
def test_hf_arch_rejects_what_it_does_not_build(change, match):
    with pytest.raises(ValueError, match=match):
        hf_arch(tiny_hf_config(**change))


@pytest.mark.parametrize("vocab,tp,expected", [
    (152064, 1, 152064), (152064, 4, 152064), (152064, 8, 152064),  # Qwen2.5-7B/32B
    (151936, 1, 151936), (151936, 2, 151936), (151936, 8, 151936),  # Qwen2.5-0.5B..3B
    (151655, 1, 151680), (151655, 8, 151680),  # a tokenizer-sized vocab: padded, same at any TP
    (120, 3, 120), (121, 3, 144),  # TP that does not divide divisible_by: multiple of lcm
])
def test_padded_vocab_size(vocab, tp, expected):
    assert padded_vocab_size(vocab, 128 if vocab > 1000 else 8, tp) == expected


def test_transformer_config_fields():
    cfg = transformer_config_from_hf(tiny_hf_config(), model=MODEL, parallel=ONE, on_gpu=False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.activation_func is F.silu and cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-6
    assert cfg.transformer_impl == "local" and cfg.params_dtype == torch.float32 and not cfg.bf16
    assert cfg.hidden_dropout == 0.0 and not cfg.apply_rope_fusion and not cfg.bias_activation_fusion


def test_recompute_and_interleaving_settings():
    sel = transformer_config_from_hf(tiny_hf_config(), model=ModelConfig(recompute="selective"), parallel=ONE)
    assert sel.recompute_granularity == "selective" and sel.recompute_modules == ["core_attn"]
    full = transformer_config_from_hf(tiny_hf_config(), model=ModelConfig(recompute="full"), parallel=ONE)
    assert (full.recompute_granularity, full.recompute_method) == ("full", "uniform")
    assert full.recompute_num_layers == 1
    hf = tiny_hf_config(num_hidden_layers=8)
    # docs/reference/megatron_on_cpu.md 3b: only PP=2 pairs prev == next
    for pp, batch_p2p in ((2, False), (4, True)):
        par = ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2)
        cfg = transformer_config_from_hf(hf, model=MODEL, parallel=par)
        # The shape exchange always batches its ops, so interleaved PP=2 exchanges no shapes.
        assert cfg.batch_p2p_comm is batch_p2p and cfg.variable_seq_lengths is batch_p2p
        assert cfg.pipeline_dtype == torch.float32


def test_runtime_resolution(monkeypatch):
    import importlib.util
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ValueError, match="needs Transformer Engine"):
            resolve_runtime(ModelConfig(), on_gpu=True)
        from megatron.core.extensions import transformer_engine as mcore_te
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # pretend it is there,
        monkeypatch.setattr(mcore_te, "HAVE_TE", True)  # and usable by megatron (tests/unit/test_te_detection.py)
    gpu = resolve_runtime(ModelConfig(), on_gpu=True)
    assert (gpu.transformer_impl, gpu.params_dtype) == ("transformer_engine", torch.bfloat16)
    cpu = resolve_runtime(ModelConfig(), on_gpu=False)
    assert (cpu.transformer_impl, cpu.params_dtype) == ("local", torch.float32)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_runtime(ModelConfig(transformer_impl="transformer_engine"), on_gpu=False)
    with pytest.raises(ValueError, match="fp8"):
        resolve_runtime(ModelConfig(fp8="hybrid"), on_gpu=False)


@pytest.mark.parametrize("hf_change,parallel,world,match", [
    ({}, dict(tensor_model_parallel_size=3), 3, "num_attention_heads=4 is not divisible"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4}, dict(tensor_model_parallel_size=3), 3,
     r"num_key_value_heads=4 and tensor_model_parallel_size=3: neither divides the other .*: \[1\]$"),
    ({"num_hidden_layers": 6}, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     2, "num_hidden_layers=6 is not divisible by .* 2 x 2"),
    ({}, dict(tensor_model_parallel_size=2), 3, "world size 3 is not divisible"),
    ({**TINY_MOE, "model_type": "qwen3_moe"}, dict(context_parallel_size=2, expert_model_parallel_size=4), 2,
     r"expert_model_parallel_size=4 does not divide DP x CP = 1 x 2 .*pick one of \[1, 2\]"),
    # the TP sizes a refusal offers count EP over DP x CP: TP 1 (DP 12 x CP 2 = 24 ranks for EP 8) fits
    ({**TINY_MOE, "model_type": "qwen3_moe", "num_experts": 8},
     dict(tensor_model_parallel_size=3, context_parallel_size=2, expert_model_parallel_size=8), 24,
     r"num_attention_heads=4 is not divisible by tensor_model_parallel_size=3; .*: \[1\]$"),
])
def test_validate_parallel_names_values_and_fix(hf_change, parallel, world, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel(tiny_hf_config(**hf_change), parallel=ParallelConfig(**parallel), model=MODEL,
                          world_size=world, on_gpu=False)


def test_every_tp_a_layout_error_suggests_is_one_the_layout_accepts():
    """For each Qwen2.5 / Qwen3 shape, world size and PP (with the tied-embedding rule of PP 2 under the
    distributed optimizer), every TP the model cannot take is refused with a list of sizes, and each of
    them, set, passes the whole layout check (`megatron-dapo config`'s). Qwen2.5-7B's 28 heads alone
    would allow 7, 14 and 28; its 4 KV heads and 18944-wide MLP take none of them."""
    import dataclasses
    import itertools
    import re

    from megatron_dapo.config_loading import load_config
    from megatron_dapo.convert.synthetic import SHAPES
    from megatron_dapo.errors import ConfigError
    from megatron_dapo.layout import describe_layout, model_shape

    def layout(cfg, world, hf, tp):
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp))
        return describe_layout(cfg, world, hf, "test", on_gpu=False)

    def refusal(cfg, world, hf, tp) -> str | None:
        try:
            layout(cfg, world, hf, tp)
        except ConfigError as e:
            return str(e)
        return None

    suggested = {}
    batches = {512: [], 448: ["data.prompts_per_step=448", "train.mini_batch_prompts=28"]}  # responses per update
    for (batch, overrides), pp in itertools.product(batches.items(), (1, 2)):
        cfg = load_config(None, [f"parallel.pipeline_model_parallel_size={pp}", *overrides])
        for shape in SHAPES:
            hf, _ = model_shape(cfg.model, shape)
            for world in (8, 16, 28, 40, 64):
                for tp in (t for t in range(2, world + 1) if world % (t * pp) == 0):
                    error = refusal(cfg, world, hf, tp)
                    if error is None or "tensor_model_parallel_size=" not in error:  # fits, or PP's layers
                        continue
                    found = re.findall(r"\[[\d, ]+\]", error)
                    assert found, f"{shape} TP {tp} at world {world}: no sizes suggested: {error}"
                    fits = [int(v) for v in found[0].strip("[]").split(",")]
                    if "none of which splits" in error:  # the model's sizes, each refused for the batch alone
                        assert all("do not split over DP" in refusal(cfg, world, hf, fit) for fit in fits), error
                        continue
                    suggested[(shape, world, pp, batch, tp)] = fits
                    for fit in fits:
                        layout(cfg, world, hf, fit)  # raises when a suggestion does not work
    assert suggested[("7B", 8, 1, 512, 8)] == suggested[("7B", 28, 1, 448, 7)] == [1, 2, 4]
    assert ("7B", 28, 1, 512, 7) not in suggested  # DP 28, 14 or 7 cannot split 512 responses: said instead
    assert suggested[("0.5B", 16, 2, 512, 4)] == [1]  # tied: TP 2 with PP 2 would shift the embedding's state
    assert suggested[("32B", 64, 1, 512, 16)] == [1, 2, 4, 8]


def test_validate_parallel_accepts_replicated_kv_groups():
    """megatron-core 0.19.2 replicates KV groups when there are fewer than TP ranks."""
    sizes = validate_parallel(tiny_hf_config(num_attention_heads=8, num_key_value_heads=2, vocab_size=151936),
                              parallel=ParallelConfig(tensor_model_parallel_size=4), model=ModelConfig(),
                              world_size=8, on_gpu=False)
    assert sizes == dict(data_parallel_size=2, padded_vocab_size=151936, layers_per_chunk=2)


@pytest.fixture
def world_of_one(monkeypatch):
    """initialize_parallel without a launcher (no RANK in the environment) starts a one-process
    gloo world; torn down after the test."""
    from megatron_dapo.mcore import initialize_parallel

    monkeypatch.delenv("RANK", raising=False)
    yield lambda hf, model=MODEL: initialize_parallel(hf, parallel=ONE, model=model, seed=3)
    destroy_parallel()


def test_recompute_gives_identical_grads(world_of_one):
    hf = tiny_hf_config()
    world_of_one(hf)
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    grads, state = {}, None  # the first model's weights, loaded into the others
    for mode in ("none", "selective", "full"):
        model_cfg = ModelConfig(make_vocab_size_divisible_by=8, recompute=mode)
        (model,) = build_model(hf, model=model_cfg, parallel=ONE)
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        lp, ent = vocab_parallel_logprobs(model(ids, pos, None), torch.roll(ids, -1, 1), temperature=1.0)
        (lp.sum() + ent.sum()).backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grads["none"], grads["selective"]) and torch.equal(grads["none"], grads["full"])


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_qwen2(world_of_one, tied):
    hf = tiny_hf_config(tie_word_embeddings=tied)
    world_of_one(hf)
    torch.manual_seed(0)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs, rope_theta=1e6,
                                                                 attn_implementation="eager")).eval()
    (model,) = build_model(hf, model=MODEL, parallel=ONE)
    missing = model.load_state_dict(hf_to_megatron_by_hand(ref.state_dict(), hf_arch(hf)), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, 16), None)
        theirs = ref(ids).logits
        fresh = build_model(hf, model=MODEL, parallel=ONE)[0](ids, torch.arange(16).expand(2, 16), None)
    assert (fresh - theirs).abs().max() > 0.1  # the comparison can fail
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # measured: bit-identical


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_qwen3(world_of_one, tied):
    """Qwen3 dense: no q/k/v biases, RMSNorm over each head's query and key (random weights, so a
    norm skipped or applied after RoPE shows), a head size of 32 over a width of 64 with 4 heads."""
    hf = tiny_hf_config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                        tie_word_embeddings=tied)
    world_of_one(hf)
    torch.manual_seed(0)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs, rope_theta=1e6,
                                                                 attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    (model,) = build_model(hf, model=MODEL, parallel=ONE)
    missing = model.load_state_dict(hf_to_megatron_by_hand(ref.state_dict(), hf_arch(hf)), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    assert model.decoder.layers[0].self_attention.linear_qkv.bias is None
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, 16), None)
        theirs = ref(ids).logits
        for layer in model.decoder.layers:  # without the per-head norms the logits differ
            layer.self_attention.q_layernorm.weight.fill_(1.0)
        unnormed = model(ids, torch.arange(16).expand(2, 16), None)
    assert (unnormed - theirs).abs().max() > 0.05
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_layout_whose_resume_megatron_corrupts_is_refused():
    """tests/distributed/test_upstream_tied_embedding_ckpt.py shows why; the neighbours are fine."""
    import dataclasses

    from megatron_dapo.mcore.parallel import check_training_layout

    bad = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="set parallel.use_distributed_optimizer=false, or TP=1, or PP=1"):
        check_training_layout({"tie_word_embeddings": True}, bad)
    check_training_layout({"tie_word_embeddings": False}, bad)
    check_training_layout({"tie_word_embeddings": True}, dataclasses.replace(bad, use_distributed_optimizer=False))
    check_training_layout({"tie_word_embeddings": True}, dataclasses.replace(bad, pipeline_model_parallel_size=1))


def test_a_qwen2_checkpoint_is_refused_under_a_qwen3_model_and_an_older_one_still_loads(tmp_path):
    """The checkpoint's model shape records the attention features (add_qkv_bias, qk_layernorm): a
    Qwen2 checkpoint under a Qwen3 base of the same sizes is refused in one line naming them; a
    checkpoint written before they were recorded is checked on the fields it has."""
    from megatron_dapo.errors import InputError
    from megatron_dapo.mcore.checkpoint import check_model_shape
    from megatron_dapo.launch_checks import model_shape_of

    qwen2 = tiny_hf_config()
    qwen3 = tiny_hf_config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16)
    saved = {"model_shape": model_shape_of(qwen2)}
    with pytest.raises(InputError, match=r"another model shape \(add_qkv_bias True -> False, qk_layernorm False -> "
                                         r"True; checkpoint -> this run's model\)"):
        check_model_shape(tmp_path, saved, model_shape_of(qwen3))
    older = {"model_shape": {k: v for k, v in model_shape_of(qwen2).items()
                             if k not in ("add_qkv_bias", "qk_layernorm")}}
    check_model_shape(tmp_path, older, model_shape_of(qwen2))
    with pytest.raises(InputError, match=r"kv_channels 16 -> 32"):
        check_model_shape(tmp_path, older, model_shape_of(tiny_hf_config(head_dim=32)))


def test_an_moe_checkpoint_is_refused_under_a_dense_model_and_the_reverse(tmp_path):
    """The shape records the experts (num_moe_experts, moe_ffn_hidden_size; 0 for a dense model): a Qwen3-MoE
    checkpoint under a Qwen3 dense model of the same attention is refused in one line naming them, and the
    reverse."""
    from megatron_dapo.errors import InputError
    from megatron_dapo.mcore.checkpoint import check_model_shape
    from megatron_dapo.launch_checks import model_shape_of
    from tests.helpers.moe import TINY_MOE

    moe = {**TINY_MOE, "model_type": "qwen3_moe", "rms_norm_eps": 1e-6, "max_position_embeddings": 64}
    dense = {**moe, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    for saved, run, diff in ((moe, dense, "num_moe_experts 4 -> 0, moe_ffn_hidden_size 32 -> 0"),
                             (dense, moe, "num_moe_experts 0 -> 4, moe_ffn_hidden_size 0 -> 32")):
        with pytest.raises(InputError, match=rf"another model shape \({diff}; checkpoint -> this run's model\)"):
            check_model_shape(tmp_path, {"model_shape": model_shape_of(saved)}, model_shape_of(run))


def test_a_checkpoint_of_another_vocabulary_is_refused_in_one_line_and_an_older_one_still_loads(world_of_one,
                                                                                                   tmp_path):
    """A run resumed under a model.hf_path of another vocab_size is refused before anything is built,
    naming the vocabulary (not the padding knobs): the saved shape records vocab_size, the same on the
    run's side (launch_checks.model_shape_of of config.json) and the model's (checkpoint.model_shape of a built model).
    A checkpoint written before vocab_size was recorded is checked on the fields it has."""
    from megatron_dapo.errors import InputError
    from megatron_dapo.mcore.checkpoint import check_model_shape, model_shape
    from megatron_dapo.launch_checks import model_shape_of

    hf = tiny_hf_config()
    world_of_one(hf)
    built = build_model(hf, model=ModelConfig(), parallel=ONE)  # pads 120 rows to 128
    assert built[0].vocab_size == 128 and model_shape(built) == model_shape_of(hf)
    assert model_shape_of(hf)["vocab_size"] == 120
    saved = {"model_shape": model_shape_of(hf)}
    # 100 rows: at the default make_vocab_size_divisible_by=128 both pad to 128 rows, so megatron's
    # loader would take the checkpoint without a word; at MODEL's 8 the padded sizes differ as well
    other = model_shape_of(tiny_hf_config(vocab_size=100))
    fix = "resume with the model it was trained with"
    with pytest.raises(InputError, match=rf"^checkpoint {tmp_path} holds another model shape \(vocab_size 120 -> 100; "
                                         rf"checkpoint -> this run's model\): {fix}$"):
        check_model_shape(tmp_path, saved, other, fix=fix)
    older = {"model_shape": {k: v for k, v in model_shape_of(hf).items() if k != "vocab_size"}}
    check_model_shape(tmp_path, older, other)
