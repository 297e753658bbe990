"""Config schema, YAML inheritance, overrides and the errors users see."""

from pathlib import Path

import pytest

from megatron_dapo.config import DAPOConfig, ParallelConfig
from megatron_dapo.config_loading import ConfigError, defaults_yaml, dump_yaml, load_config, to_dict

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_base_yaml_is_generated_from_the_schema():
    assert (CONF / "base.yaml").read_text() == defaults_yaml(), (
        "conf/base.yaml is stale: run `megatron-dapo config --defaults > conf/base.yaml`")


def test_base_yaml_loads_to_the_defaults_and_every_key_has_a_comment():
    assert load_config(CONF / "base.yaml") == DAPOConfig()
    for line in (CONF / "base.yaml").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, rest = line.partition(":")
            assert "  # " in rest and rest.split("  # ", 1)[1].strip(), f"no comment on {key.strip()}"


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_shipped_config_validates(path):
    load_config(path)


def test_paper_defaults():
    c = DAPOConfig()
    loss = c.loss_settings()
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c, loss.loss_agg_mode) == \
        (0.2, 0.28, 10.0, "token-mean")
    assert (c.data.prompts_per_step, c.rollout.n, c.train.mini_batch_prompts) == (512, 16, 32)
    assert c.updates_per_step == 16
    assert (c.rollout.max_response_length, c.reward.overlong_buffer.len) == (20480, 4096)
    assert (c.optim.lr, c.optim.lr_warmup_steps) == (1e-6, 20)
    assert (c.eval.temperature, c.eval.top_p, c.eval.n) == (1.0, 0.7, 32)
    assert c.algorithm.filter_groups.enable
    assert not c.reward.overlong_filter
    assert not c.algorithm.rollout_correction.active  # rollout correction: off unless asked for


def test_defaults_chain_and_override_precedence(tmp_path):
    (tmp_path / "parent.yaml").write_text("seed: 7\nloss:\n  clip_ratio_high: 0.3\nrollout:\n  n: 8\n")
    (tmp_path / "child.yaml").write_text("defaults: parent.yaml\nrollout:\n  n: 4\n")
    cfg = load_config(tmp_path / "child.yaml", ["seed=9", "optim.lr=1e-5", "loss.clip_ratio_c=null",
                                                "data.train_files=[a.parquet, b.jsonl]"])
    assert cfg.seed == 9 and cfg.rollout.n == 4 and cfg.loss.clip_ratio_high == 0.3
    assert cfg.loss.clip_ratio_low == "auto" and cfg.loss_settings().clip_ratio_low == 0.2  # dapo's paper value
    assert cfg.optim.lr == 1e-5 and cfg.loss.clip_ratio_c is None
    assert cfg.data.train_files == ("a.parquet", "b.jsonl")
    assert load_config(None, ["data.train_files=x.parquet"]).data.train_files == ("x.parquet",)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.n=4", "data.train_files=[a.parquet]"])
    (tmp_path / "resolved.yaml").write_text(dump_yaml(cfg))
    assert load_config(tmp_path / "resolved.yaml") == cfg
    assert to_dict(cfg)["data"]["train_files"] == ["a.parquet"]


def test_routing_replay_refuses_recompute():
    with pytest.raises(ConfigError, match="moe.router_replay=R3 with model.recompute=full is not supported"):
        load_config(None, ["moe.router_replay=R3", "model.recompute=full", "rollout.engine=hf"])


@pytest.mark.parametrize("override, message", [
    ("loss.clip_ratio_hgih=0.3", "unknown config key loss.clip_ratio_hgih; did you mean loss.clip_ratio_high"),
    ("lossx.a=1", "unknown config key lossx"),
    ("rollout.n=abc", "rollout.n must be an integer, got 'abc'"),
    ("rollout.n=2.5", "rollout.n must be an integer"),
    ("data.shuffle=1", "data.shuffle must be true or false"),
    ("rollout.engine=sglang", "rollout.engine='sglang' is not one of ['hf', 'vllm']"),
    ("train.mini_batch_prompts=30",
     "data.prompts_per_step=512 is not divisible by train.mini_batch_prompts=30; pick a divisor (e.g. 32)"),
    ("reward.overlong_buffer.len=30000",
     "reward.overlong_buffer.len=30000 must be in (0, rollout.max_response_length=20480]"),
    ("loss.clip_ratio_low=1.2", "loss.clip_ratio_low must be in [0, 1] (1: no lower bound), got 1.2"),
    ("loss.clip_ratio_c=1.1", "loss.clip_ratio_c=1.1 must exceed 1 + clip_ratio_high = 1.28"),
    ("loss.clip_ratio_high=9.5",  # the dual clip left at auto: dapo's 10.0 now sits inside the clip range
     "loss.clip_ratio_c=auto is dapo's 10.0: loss.clip_ratio_c=10.0 must exceed 1 + clip_ratio_high = 10.5"),
    ("loss.loss_agg_mode=token-sum", "loss.loss_agg_mode='token-sum' is not one of"),
    ("loss.tis_cap=2", "moved to algorithm.rollout_correction: set algorithm.rollout_correction.rollout_is=token"),
    ("algorithm.rollout_correction.rollout_is_threshold=0", "rollout_is_threshold=0.0: need an upper bound > 0"),
    ("algorithm.rollout_correction.rollout_is_threshold=5.0_0.5", "0 < lower <= upper"),
    ("algorithm.rollout_correction.rollout_rs=token_k4", "options are token_k1"),
    ("algorithm.rollout_correction.rollout_rs=token_k2", "needs rollout_rs_threshold"),
    ("algorithm.rollout_correction.rollout_is=token", None),
    ("algorithm.rollout_correction.rollout_is_threshold=0.5_5.0", None),  # IcePop
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator='gae' is not one of ['grpo', 'grpo_mean_only']"),
    ("rollout.n=1", "rollout.n must be >= 2"),
    ("reward.fn=gsm8k", "reward.fn='gsm8k' is not one of ['dapo_math', 'math_dapo_paper']"),
    ("eval.reward_fn=gsm8k", "eval.reward_fn='gsm8k' is not one of ['dapo_math', 'math_dapo_paper']"),
    ("reward.fn=math_dapo_paper", None),
    ("train.max_tokens_per_micro_batch=4096", "cannot hold one sequence of data.max_prompt_length + "
                                              "rollout.max_response_length = 22528 tokens"),
    ("parallel.sequence_parallel=true", "sequence_parallel=true needs tensor_model_parallel_size > 1"),
    ("model.fp8=e4m3", None),  # valid: auto picks TE on GPU
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("lr=1", "unknown config key lr"),
    ("optim.lr", "is not of the form key.path=value"),
    ("loss=3", "loss must be a mapping"),
    ("toy.architecture=qwen4", "toy.architecture must be one of qwen2, qwen3, qwen3_moe, got qwen4"),
    ("toy.head_dim=32", "toy.head_dim=32 needs toy.architecture=qwen3"),  # vLLM's Qwen2 reads no head_dim
    ("toy.num_experts_per_tok=9", "toy.num_experts_per_tok=9 exceeds toy.num_experts=8"),
    ("toy.num_experts_per_tok=1", "toy.num_experts_per_tok must be >= 2, got 1"),
    ("moe.aux_loss_coeff=-1", "moe.aux_loss_coeff must be >= 0 or auto, got -1"),
])
def test_bad_values_fail_early_with_the_fix(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_cross_field_errors_need_two_overrides():
    with pytest.raises(ConfigError, match="model.fp8 needs Transformer Engine"):
        load_config(None, ["model.fp8=e4m3", "model.transformer_impl=local"])
    with pytest.raises(ConfigError, match="needs a value >= 2 and pipeline_model_parallel_size > 1"):
        load_config(None, ["parallel.virtual_pipeline_model_parallel_size=2"])


def test_gen_prompts_per_batch_is_unused_without_dynamic_sampling():
    """Without dynamic sampling a generation batch is the step's prompts: a gen_prompts_per_batch
    below prompts_per_step is accepted, and what the run is planned to generate (the layout's
    batch line, the plan's step time) is the same for any value. With dynamic sampling on the
    same probes do see the key, so they can tell."""
    from megatron_dapo.layout import describe_layout, model_shape
    from megatron_dapo.memory_plan import plan

    def planned(enable: bool, gen: int) -> tuple[str, float]:
        cfg = load_config(None, [f"algorithm.filter_groups.enable={str(enable).lower()}",
                                 f"data.gen_prompts_per_batch={gen}", "data.prompts_per_step=16",
                                 "train.mini_batch_prompts=4"])
        assert cfg.data.gen_prompts_per_batch == gen  # loaded as given, not rewritten
        hf, source = model_shape(cfg.model, "0.5B")
        return describe_layout(cfg, 1, hf, source, on_gpu=False), plan(cfg, hf, 1).step_s

    off = planned(False, 8)
    assert planned(False, 64) == off
    assert "generation batches of 16 prompts" in off[0]  # data.prompts_per_step
    on_small, on_large = planned(True, 8), planned(True, 64)
    assert "generation batches of 8 prompts" in on_small[0] and on_small[1] < on_large[1]


def test_world_size_divisibility():
    p = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert p.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="world size 6 is not divisible by TP x PP x CP = 2 x 2 x 1 = 4"):
        p.data_parallel_size(6)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="defaults cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(tmp_path / "bad.yaml")


def test_the_logprob_chunk_setting_reaches_the_train_step():
    from megatron_dapo.config import TrainConfig
    from megatron_dapo.mcore.step_settings import StepSettings

    assert StepSettings.from_config(DAPOConfig(), 1000, packed=False).chunk_tokens is None  # logprobs.py's default
    chunked = DAPOConfig(train=TrainConfig(logprob_chunk_tokens=64))
    assert StepSettings.from_config(chunked, 1000, packed=False).chunk_tokens == 64
    with pytest.raises(ConfigError, match="train.logprob_chunk_tokens must be >= 0"):
        TrainConfig(logprob_chunk_tokens=-1)
