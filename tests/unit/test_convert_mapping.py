"""The Qwen2 mapping table, without megatron: names, layouts, TP splits, round trips, errors."""

import pytest
import torch

from megatron_dapo.convert import (
    ConversionError, conversion_table, hf_to_megatron_state_dict, megatron_to_hf_state_dict, merge_tp,
    shard_plan, split_tp, supported_architectures,
)
from megatron_dapo.convert.synthetic import QWEN25_CONFIGS
from tests.helpers.convert import TINY, hf_state_dict

@pytest.mark.parametrize("tied", [False, True])
def test_every_hf_key_mapped_exactly_once(tied):
    config, sd = hf_state_dict(tie_word_embeddings=tied)
    table = conversion_table(config)
    names = table.hf_names()
    assert len(names) == len(set(names)) and set(names) == set(sd)
    megatron = [t.megatron_name() for t in table.tasks]
    assert len(megatron) == len(set(megatron))
    assert ("output_layer.weight" in megatron) == (not tied)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_has_per_head_norms_and_no_qkv_bias_under_both_specs(tied):
    config, sd = hf_state_dict("qwen3", tie_word_embeddings=tied)
    assert "model.layers.0.self_attn.q_proj.bias" not in sd
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (24,)
    table = conversion_table(config, padded_vocab_size=128)
    assert set(table.hf_names()) == set(sd)
    for spec in ("local", "te"):
        mc = hf_to_megatron_state_dict(table, sd, spec=spec)
        assert torch.equal(mc["decoder.layers.1.self_attention.k_layernorm.weight"],
                           sd["model.layers.1.self_attn.k_norm.weight"])
        assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 24, 32)
        assert mc["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 4 * 24)
        assert not any(name.endswith("linear_qkv.bias") for name in mc)
        shards = split_tp(table, mc, 2)
        assert torch.equal(shards[1]["decoder.layers.0.self_attention.q_layernorm.weight"],
                           sd["model.layers.0.self_attn.q_norm.weight"])  # replicated over TP
        back = megatron_to_hf_state_dict(table, merge_tp(table, shards))
        assert set(back) == set(sd) and all(torch.equal(back[n], t) for n, t in sd.items())
    with pytest.raises(ConversionError, match="Qwen3 with attention_bias=true is unsupported"):
        conversion_table({**config, "attention_bias": True})
    with pytest.raises(ConversionError, match="Qwen3 config.json without head_dim: its size is not hidden_size"):
        conversion_table({k: v for k, v in config.items() if k != "head_dim"})
    with pytest.raises(ConversionError, match="Qwen3 with use_sliding_window=true"):
        conversion_table({**config, "layer_types": ["full_attention", "sliding_attention"]})


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("tied", [False, True])
def test_tp1_names_and_tp2_split_merge_roundtrip_is_identity(spec, tied):
    config, sd = hf_state_dict(tie_word_embeddings=tied)
    table = conversion_table(config, padded_vocab_size=128)
    mc = hf_to_megatron_state_dict(table, sd, spec=spec)
    norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    assert f"decoder.layers.1.{norm}" in mc
    assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert mc["decoder.layers.0.self_attention.linear_qkv.bias"].shape == ((4 + 2 * 2) * 8,)
    assert mc["embedding.word_embeddings.weight"].shape == (128, 32)
    shards = split_tp(table, mc, 2)
    assert shards[1]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 16)  # row parallel
    assert shards[1]["embedding.word_embeddings.weight"].shape == (64, 32)
    back = megatron_to_hf_state_dict(table, merge_tp(table, shards))
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert torch.equal(back[name], t), name


def test_qkv_interleave_matches_hand_built_layout():
    """heads=4, groups=2, head_dim=2: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1] (head blocks)."""
    config = {**TINY, "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2}
    table = conversion_table(config)
    task = table.task_for_hf("model.layers.0.self_attn.q_proj.weight")
    d = 2
    q = torch.arange(4 * d * 8, dtype=torch.float32).reshape(4 * d, 8)
    k = 1000 + torch.arange(2 * d * 8, dtype=torch.float32).reshape(2 * d, 8)
    v = 2000 + torch.arange(2 * d * 8, dtype=torch.float32).reshape(2 * d, 8)
    head = lambda t, i: t[i * d:(i + 1) * d]  # noqa: E731
    expected = torch.cat([head(q, 0), head(q, 1), head(k, 0), head(v, 0),
                          head(q, 2), head(q, 3), head(k, 1), head(v, 1)])
    fused = task.mapping.to_megatron([q, k, v], table.dims)
    assert torch.equal(fused, expected)
    # TP=2 gives each rank one whole KV group.
    assert torch.equal(task.mapping.tp_split(fused, 2)[1], expected[4 * d:])
    # Biases use the same interleave.
    bias_task = table.task_for_hf("model.layers.0.self_attn.q_proj.bias")
    qb, kb, vb = q[:, 0], k[:, 0], v[:, 0]
    assert torch.equal(bias_task.mapping.to_megatron([qb, kb, vb], table.dims), expected[:, 0])
    back = bias_task.mapping.to_hf(expected[:, 0], table.dims)
    assert all(torch.equal(a, b) for a, b in zip(back, [qb, kb, vb]))


def test_fc1_tp_shards_are_gate_r_then_up_r():
    table = conversion_table(TINY)
    m = table.task_for_hf("model.layers.0.mlp.gate_proj.weight").mapping
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    shards = m.tp_split(m.to_megatron([gate, up], table.dims), 2)
    assert torch.equal(shards[0], torch.cat([gate[:24], up[:24]]))
    assert torch.equal(shards[1], torch.cat([gate[24:], up[24:]]))
    assert torch.equal(m.tp_merge(shards), torch.cat([gate, up]))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_row_blocks_of_every_shard_concatenate_to_the_shard(arch, tp):
    """tp_shard_rows (what the converter writes part by part, copying nothing for fc1) against the
    concatenated shard tp_split gives, for every tensor of the table; fc1's blocks are views of the
    HF tensors themselves."""
    config, sd = hf_state_dict(arch)
    table = conversion_table(config, padded_vocab_size=128)
    for task in table.tasks:
        hf = [sd[n] for n in task.hf_names]
        whole = task.mapping.tp_split(task.mapping.to_megatron(hf, table.dims), tp)
        for rank in range(tp):
            rows = task.mapping.tp_shard_rows(hf, table.dims, tp, rank)
            assert torch.equal(torch.cat(rows), whole[rank]), (task.megatron_name(), rank)
            if len(task.hf_names) == 2 and len(rows) == 2:  # fc1: gate then up, untouched
                assert all(r.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
                           for r, h in zip(rows, hf)), task.megatron_name()


def test_vocab_padding_is_zero_and_truncated_on_export():
    config, sd = hf_state_dict()
    table = conversion_table(config, padded_vocab_size=112)
    mc = hf_to_megatron_state_dict(table, sd)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mc[name].shape == (112, 32) and not mc[name][100:].any()
    assert megatron_to_hf_state_dict(table, mc)["lm_head.weight"].shape == (100, 32)


def test_unsupported_architecture_lists_supported_ones():
    expected = (r"unsupported architecture LlamaForCausalLM; supported: "
                r"\['Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]")
    with pytest.raises(ConversionError, match=expected):
        conversion_table({**TINY, "architectures": ["LlamaForCausalLM"]})
    assert "Qwen2ForCausalLM" in supported_architectures()
    with pytest.raises(ConversionError, match="use_sliding_window"):
        conversion_table({**TINY, "use_sliding_window": True})
    with pytest.raises(ConversionError, match="lacks"):
        conversion_table({k: v for k, v in TINY.items() if k != "intermediate_size"})


def test_missing_unexpected_and_misshapen_tensors_are_named():
    config, sd = hf_state_dict()
    table = conversion_table(config)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ConversionError, match=r"missing \['model.layers.1.self_attn.k_proj.bias'\]"):
        hf_to_megatron_state_dict(table, missing)
    with pytest.raises(ConversionError, match=r"unexpected \['model.layers.2.mlp.up_proj.weight'\]"):
        hf_to_megatron_state_dict(table, {**sd, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    bad = {**sd, "model.layers.0.mlp.down_proj.weight": torch.zeros(32, 47)}
    with pytest.raises(ConversionError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(32, 47\), "
                                              r"expected \(32, 48\)"):
        hf_to_megatron_state_dict(table, bad)
    with pytest.raises(ConversionError, match="unexpected Megatron parameter 'decoder.layers.0.foo.weight'"):
        megatron_to_hf_state_dict(table, {"decoder.layers.0.foo.weight": torch.zeros(1)})


def test_tp_must_split_heads_groups_ffn_and_vocab_evenly():
    table = conversion_table(TINY)  # 4 heads, 2 KV groups, ffn 48, vocab 100
    table.check_parallel(4, 2)  # TP a multiple of the KV groups is fine (megatron replicates them)
    with pytest.raises(ConversionError, match=r"TP=3 does not divide .*'num_key_value_heads': 2"):
        table.check_parallel(3)
    with pytest.raises(ConversionError, match="PP=3 does not divide num_hidden_layers=2"):
        table.check_parallel(1, 3)


def test_32b_dry_run_on_meta_tensors():
    rows = shard_plan(QWEN25_CONFIGS["32B"], tp=8, pp=2)
    assert len(rows) == 16
    first = rows[0].tensors
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"] == ((40 + 2 * 8) * 128 // 8, 5120)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 27648 // 8, 5120)
    assert first["embedding.word_embeddings.weight"] == (152064 // 8, 5120)
    assert "decoder.layers.32.mlp.linear_fc2.weight" in rows[8].tensors  # stage 1 starts at layer 32
    assert sum(r.num_params for r in rows[::8]) * 8 > 32e9  # every rank's share, both stages
