"""train.pack_sequences=auto (micro_batch_shapes.py): packed where every micro-batch must have one [b, s],
on the local spec; padded elsewhere.

The reference is a table of layouts written from megatron-core 0.19.2's two rules (pipeline stages that
cannot exchange shapes: interleaved PP 2; the allgather token dispatcher of an MoE model under EP or PP),
checked on each: the launch's choice (from the config and config.json, before any model), the actor's
(from the built TransformerConfig), megatron's own fields of that config (``variable_seq_lengths``, the
dispatcher), and the train step's micro-batch settings built from the actor's choice
(mcore/micro_batches.batching_kwargs). tests/distributed/test_policy_train_step.py checks an actor's
settings at PP 2 x VPP 2 (packed) and TP 2, PP 2 (padded).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dapo.config import DAPOConfig, ModelConfig, ParallelConfig, TrainConfig
from megatron_dapo.config_moe import MoEConfig
from megatron_dapo.micro_batch_shapes import AUTO, from_transformer_config, launch_pack_choice, pack_choice
from tests.helpers.moe import TINY_MOE
from tests.helpers.policy import tiny_hf_config

DENSE = tiny_hf_config(num_hidden_layers=8)
MOE = {**TINY_MOE, "num_hidden_layers": 4, "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
       "max_position_embeddings": 128, "norm_topk_prob": True}

LAYOUTS = [  # (hf config.json, parallel, moe, packed by auto on the local spec)
    pytest.param(DENSE, {}, {}, False, id="dense"),
    pytest.param(DENSE, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}, False, id="dense-tp2-sp"),
    pytest.param(DENSE, dict(context_parallel_size=2), {}, False, id="dense-cp2"),
    pytest.param(DENSE, dict(pipeline_model_parallel_size=2), {}, False, id="dense-pp2"),
    pytest.param(DENSE, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {}, True,
                 id="dense-pp2-vpp2"),
    pytest.param(DENSE, dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), {}, False,
                 id="dense-pp4-vpp2"),
    pytest.param(MOE, {}, {}, False, id="moe-ep1"),
    pytest.param(MOE, dict(expert_model_parallel_size=2), {}, True, id="moe-ep2"),
    pytest.param(MOE, dict(expert_model_parallel_size=2), dict(token_dispatcher="alltoall"), False,
                 id="moe-ep2-alltoall"),
    pytest.param(MOE, dict(pipeline_model_parallel_size=2), {}, True, id="moe-pp2"),
]


@pytest.mark.parametrize("hf, parallel, moe, packed", LAYOUTS)
def test_auto_packs_exactly_where_every_micro_batch_has_one_shape(hf, parallel, moe, packed):
    from megatron_dapo.mcore.micro_batches import batching_kwargs
    from megatron_dapo.mcore.model import transformer_config_from_hf
    from megatron_dapo.mcore.step_settings import StepSettings

    cfg = DAPOConfig(parallel=ParallelConfig(**parallel), moe=MoEConfig(**moe))
    assert cfg.train.pack_sequences == AUTO  # the default
    at_launch, why = launch_pack_choice(AUTO, hf, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe, on_gpu=False)
    assert at_launch is packed, why
    built = transformer_config_from_hf(hf, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe, on_gpu=False)
    in_actor = from_transformer_config(AUTO, built)
    assert in_actor == (at_launch, why)
    # megatron's own fields of that config: stages without a shape exchange, or the allgather dispatcher's EP
    allgather_ep = built.expert_model_parallel_size > 1 and built.moe_token_dispatcher_type == "allgather"
    assert ((built.pipeline_model_parallel_size > 1 and not built.variable_seq_lengths) or allgather_ep) is packed
    settings = StepSettings.from_config(cfg, hf["vocab_size"], packed=in_actor[0])
    step_rule = batching_kwargs([SimpleNamespace(config=built)], settings)
    assert step_rule["uniform"] is packed and step_rule["packed"] is packed


def test_auto_pads_on_the_transformer_engine_spec_and_a_set_value_stands():
    packed, why = pack_choice(AUTO, transformer_impl="transformer_engine", one_shape=True)
    assert not packed and "has not run here" in why
    # a GPU launch: Transformer Engine's spec and the alltoall dispatcher by default
    gpu = launch_pack_choice(AUTO, MOE, model=ModelConfig(), parallel=ParallelConfig(expert_model_parallel_size=2),
                             moe=MoEConfig(), on_gpu=True)
    assert gpu[0] is False
    for given in (True, False):
        assert pack_choice(given, transformer_impl="local", one_shape=not given) == (given, "set")


def test_the_choice_is_logged_and_recorded_in_config_yaml(tmp_path):
    from megatron_dapo.config_derived import comments, derive_for_model
    from megatron_dapo.config_loading import dump_yaml, load_config

    cfg = DAPOConfig(parallel=ParallelConfig(expert_model_parallel_size=2))
    (d,) = derive_for_model(cfg, MOE, on_gpu=False)
    assert d.kept and d.line().startswith("train.pack_sequences: auto -> true (every micro-batch must have one shape")
    assert derive_for_model(cfg, DENSE, on_gpu=False)[0].line().startswith("train.pack_sequences: auto -> false")
    explicit = DAPOConfig(train=TrainConfig(pack_sequences=False))
    assert derive_for_model(explicit, MOE, on_gpu=False) == []
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg) + comments([d]))
    assert "pack_sequences: auto" in path.read_text() and "#   train.pack_sequences: auto -> true" in path.read_text()
    assert load_config(path) == cfg  # the config keeps auto: another machine decides again


def test_a_value_other_than_true_false_or_auto_is_one_line():
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.pack_sequences=yes please"])
    assert str(e.value) == "train.pack_sequences must be true or false, got 'yes please', or one of ['auto']"
    assert load_config(None, ["train.pack_sequences=true"]).train.pack_sequences is True
