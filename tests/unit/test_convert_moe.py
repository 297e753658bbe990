"""The Qwen3-MoE mapping table without megatron: its HF names against what transformers' own
save_pretrained writes, the Megatron layout against the tests' second statement of it
(tests/helpers/moe.py), round trips at TP=1 and 2, an EP rank's expert numbering, the fused in-memory
experts of transformers 5 (convert/fused_experts.py) against from_pretrained, and the refusals.

One tiny Qwen3MoeForCausalLM saved once per module (``saved``) serves every test."""

import json
import re

import pytest
import torch

from megatron_dapo.convert import (
    ConversionError, conversion_table, fused_experts, hf_to_megatron_state_dict, megatron_to_hf_state_dict,
    merge_tp, split_tp,
)
from megatron_dapo.convert import export
from tests.helpers.convert import hf_state_dict, stand_in_chunk
from tests.helpers.moe import moe_hf_to_megatron_by_hand, read_hf_dir, save_tiny_moe, tiny_moe_model

EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF dir, its config.json, its tensors) of a tiny Qwen3-MoE written by save_pretrained."""
    path = save_tiny_moe(tmp_path_factory.mktemp("qwen3_moe"))
    config, tensors = read_hf_dir(path)
    return path, config, tensors


def test_table_names_are_the_ones_save_pretrained_writes(saved):
    _, config, tensors = saved
    table = conversion_table(config)
    assert table.architecture == "Qwen3MoeForCausalLM" and table.dims.num_experts == 4
    names = table.hf_names()
    assert len(names) == len(set(names)) and set(names) == set(tensors)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # per expert, as on disk
    megatron = [t.megatron_name() for t in table.tasks]
    assert len(megatron) == len(set(megatron))
    for name in tensors:  # shapes as written
        table.check_hf_shape(name, tensors[name].shape)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_megatron_layout_matches_the_by_hand_statement_and_round_trips_bit_exact(saved, spec):
    _, config, tensors = saved
    table = conversion_table(config, padded_vocab_size=128)
    mc = hf_to_megatron_state_dict(table, tensors, spec=spec)
    by_hand = moe_hf_to_megatron_by_hand(tensors, config)
    if spec == "te":  # the TE spec fuses the attention's input norm into linear_qkv; the MoE block keeps its own
        by_hand = {k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"): v
                   for k, v in by_hand.items()}
    # vocabulary rows are padded to 128 with zeros
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mc[name].shape == (128, 64) and not mc[name][100:].any()
        mc = {**mc, name: mc[name][:100]}
    assert sorted(mc) == sorted(by_hand)
    for name, want in by_hand.items():
        assert torch.equal(mc[name], want), name
    e2 = mc["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert e2.shape == (2 * 32, 64)
    assert torch.equal(e2[:32], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])

    full = hf_to_megatron_state_dict(table, tensors, spec=spec)
    back = megatron_to_hf_state_dict(table, full)
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_tp2_splits_each_expert_as_a_dense_mlp_and_merges_back_bit_exact(saved):
    """Experts are split over TP (megatron's expert TP size is TP): rank r's linear_fc1 of expert e is
    [gate_e rows of r; up_e rows of r], its linear_fc2 the columns of r; the router is replicated."""
    _, config, tensors = saved
    table = conversion_table(config, padded_vocab_size=128)
    shards = split_tp(table, hf_to_megatron_state_dict(table, tensors), 2)
    for r in range(2):
        gate, up, down = (tensors[f"model.layers.0.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up", "down"))
        mg = "decoder.layers.0.mlp."
        assert torch.equal(shards[r][mg + "experts.local_experts.3.linear_fc1.weight"],
                           torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
        assert torch.equal(shards[r][mg + "experts.local_experts.3.linear_fc2.weight"], down.chunk(2, dim=1)[r])
        assert torch.equal(shards[r][mg + "router.weight"], tensors["model.layers.0.mlp.gate.weight"])
    back = megatron_to_hf_state_dict(table, merge_tp(table, shards))
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_an_ep_rank_maps_its_local_experts_to_global_ones(saved, monkeypatch):
    """EP=2, rank 1: megatron numbers its experts 0, 1 (of 4); they are the global experts 2, 3."""
    _, config, tensors = saved
    table = conversion_table(config, padded_vocab_size=128)
    full = hf_to_megatron_state_dict(table, tensors)
    local = {}
    for name, t in full.items():
        m = EXPERT.search(name)
        if m is None:
            local[name] = t
        elif int(m[1]) >= 2:
            local[EXPERT.sub(f".mlp.experts.local_experts.{int(m[1]) - 2}.", name)] = t
    chunk = stand_in_chunk(local, range(2))
    group = object()  # stands for the EP group: rank 1 of 2
    monkeypatch.setattr(export, "_size", lambda g: 2 if g is group else 1)
    monkeypatch.setattr(export, "_rank", lambda g: 1 if g is group else 0)
    got = export.local_parameters([chunk], table, ep_group=group)
    names = {name: p for name, p in got.values()}
    experts = sorted({(int(n.split(".")[2]), int(EXPERT.search(n)[1])) for n in names if EXPERT.search(n)})
    assert experts == [(layer, e) for layer in range(2) for e in (2, 3)]
    for name, p in names.items():
        assert torch.equal(p, full[name]), name  # each global name holds that expert's weights
    for i, (name, _) in got.items():
        assert table.tasks[i].megatron_name() == name


def test_fused_targets_fill_a_live_model_as_from_pretrained_loads_it(saved):
    """transformers 5 keeps a layer's experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    fused_experts.target copies each per-expert checkpoint tensor into its view: the logits equal
    those of the same dir loaded by from_pretrained (transformers' own conversion)."""
    from transformers import AutoModelForCausalLM

    path, _, tensors = saved
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = tiny_moe_model(seed=1)  # other random weights
    params = model.state_dict(keep_vars=True)
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # fused in memory
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
        assert (model(ids).logits - want).abs().max() > 0.1  # the comparison can fail
        for name, t in tensors.items():
            view = fused_experts.target(params, name)
            assert view is not None and view.shape == t.shape, name
            view.copy_(t)
        got = model(ids).logits
    assert fused_experts.fused_names(params, tensors) == set(params)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and the views are the ones transformers fills: expert 1's up rows are gate_up_proj[1, I:]
    fused = dict(reference.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[1, 32:], tensors["model.layers.1.mlp.experts.1.up_proj.weight"])
    assert fused_experts.target(params, "model.layers.0.mlp.experts.9.nonsense.weight") is None


def test_both_spellings_of_the_expert_count_are_read(saved):
    """transformers 5 writes num_local_experts; the released config.json files say num_experts."""
    from megatron_dapo.mcore.model import hf_arch

    _, config, _ = saved
    assert "num_local_experts" in config and "num_experts" not in config  # as transformers 5 saved it
    released = {k: v for k, v in config.items() if k != "num_local_experts"} | {"num_experts": 4}
    tables = [conversion_table(c) for c in (config, released)]
    assert [t.dims.num_experts for t in tables] == [4, 4]
    assert tables[0].hf_names() == tables[1].hf_names()
    assert [hf_arch(c).num_moe_experts for c in (config, released)] == [4, 4]
    arch = hf_arch(config)
    assert (arch.moe_ffn_hidden_size, arch.moe_router_topk, arch.moe_norm_topk_prob) == (32, 2, True)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_refusals_name_the_value(saved):
    _, config, _ = saved
    dense, _ = hf_state_dict("qwen3")
    with pytest.raises(ConversionError) as e:
        conversion_table(dense).check_parallel(1, 1, ep_size=2)
    assert _one_line(e) == "EP=2 for a dense Qwen3ForCausalLM (no experts to split); use EP=1"
    table = conversion_table(config)
    table.check_parallel(2, 2, ep_size=4)  # what divides is accepted
    with pytest.raises(ConversionError) as e:
        table.check_parallel(1, 1, ep_size=3)
    assert _one_line(e) == "EP=3 does not divide num_experts=4"
    with pytest.raises(ConversionError) as e:
        conversion_table({**config, "num_experts_per_tok": 5})
    assert _one_line(e) == "num_experts_per_tok=5 exceeds num_experts=4"
    with pytest.raises(ConversionError) as e:  # megatron-core refuses it: the one weight would be a constant 1
        conversion_table({**config, "num_experts_per_tok": 1, "norm_topk_prob": True})
    assert _one_line(e).startswith("num_experts_per_tok=1 with norm_topk_prob=true is unsupported")
    conversion_table({**config, "num_experts_per_tok": 1, "norm_topk_prob": False})  # the softmax's probability
    for change, named in (({"mlp_only_layers": [1]}, "mlp_only_layers=[1], decoder_sparse_step=1"),
                          ({"decoder_sparse_step": 2}, "mlp_only_layers=[], decoder_sparse_step=2")):
        with pytest.raises(ConversionError) as e:
            conversion_table({**config, **change})
        assert _one_line(e).startswith(f"Qwen3-MoE with dense layers ({named}) is unsupported")
    with pytest.raises(ConversionError) as e:
        conversion_table({k: v for k, v in config.items() if k != "moe_intermediate_size"})
    assert _one_line(e) == "Qwen3-MoE config.json lacks ['moe_intermediate_size']"


@pytest.mark.parametrize("ep,world,match", [
    (2, 2, None),  # EP of the two data-parallel ranks
    (3, 3, r"expert_model_parallel_size=3 does not divide the model's num_experts=4; pick one of \[1\]$"),
    (2, 3, r"expert_model_parallel_size=2 does not divide the data-parallel size 3 .*pick one of \[1\]"),
    (4, 2, r"expert_model_parallel_size=4 does not divide the data-parallel size 2 .*pick one of \[1, 2\]"),
])
def test_the_trainer_refuses_an_ep_size_the_layout_cannot_take(saved, ep, world, match):
    from megatron_dapo.config import ModelConfig, ParallelConfig
    from megatron_dapo.mcore.parallel import validate_parallel

    _, config, _ = saved
    parallel = ParallelConfig(expert_model_parallel_size=ep)
    check = lambda hf: validate_parallel(hf, parallel=parallel, model=ModelConfig(), world_size=world,  # noqa: E731
                                         on_gpu=False, check_installed=False)
    if match is None:
        assert check(config)["data_parallel_size"] == 2
        dense = json.loads(json.dumps(config))
        for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"):
            dense.pop(key)
        dense.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        with pytest.raises(ValueError, match=r"^parallel.expert_model_parallel_size=2 for a dense model \(no experts "
                                             r"to split\); set it to 1$"):
            check(dense)
    else:
        with pytest.raises(ValueError, match=match):
            check(config)
