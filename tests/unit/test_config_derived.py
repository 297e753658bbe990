"""Derived settings (config_derived.py): every "auto" / 0 / null that stands for another value and
every implied value is resolved once, to the values written out here from their sources (the
papers, verl's presets, the schema's help), said in one line each; the resolved config is a valid
config that resolves to itself, and what the machine decides stays "auto" in config.yaml."""

import dataclasses

import pytest

from megatron_dapo.config import DAPOConfig, EvalConfig, OverlongBufferConfig, RewardConfig, RolloutConfig, TrainConfig
from megatron_dapo.config_algo import FilterGroupsConfig, LossConfig
from megatron_dapo.config_derived import comments, derive, pi_old_source
from megatron_dapo.config_loading import dump_yaml, load_config


SHORT = RewardConfig(overlong_buffer=OverlongBufferConfig(len=8))  # fits a 64-token limit


def _lines(derived) -> dict[str, tuple]:
    return {d.key: (d.given, d.value, d.kept) for d in derived}


def test_the_default_config_derives_the_dapo_papers_loss_and_the_rollouts_eval_limit():
    cfg, derived = derive(DAPOConfig(), on_gpu=False)
    got = _lines(derived)
    # DAPO section 4.1: Clip-Higher 0.2 / 0.28, token-level loss; verl's DAPO recipe's dual clip 10
    assert got["loss.clip_ratio_low"] == ("auto", 0.2, False) and got["loss.clip_ratio_high"] == ("auto", 0.28, False)
    assert got["loss.clip_ratio_c"] == ("auto", 10.0, False)
    assert got["loss.loss_agg_mode"] == ("auto", "token-mean", False)
    assert (cfg.loss.clip_ratio_low, cfg.loss.clip_ratio_high, cfg.loss.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert cfg.eval.max_response_length == cfg.rollout.max_response_length == 20480
    assert got["eval.max_response_length"] == (None, 20480, False)
    # the audit scorer: eval.reward_fn (dapo_math_paper) differs from reward.fn (dapo_math)
    assert cfg.alarms.audit_fn == got["alarms.audit_fn"][1] == DAPOConfig().eval.reward_fn
    # what the machine decides stays auto in the config, and is said
    assert cfg.model.dtype == "auto" and got["model.dtype"] == ("auto", "fp32", True)
    assert got["model.transformer_impl"] == ("auto", "local", True)
    gpu = _lines(derive(DAPOConfig(), on_gpu=True)[1])
    assert gpu["model.dtype"][1] == "bf16" and gpu["model.transformer_impl"][1] == "transformer_engine"
    for d in derived:
        assert d.line().startswith(f"{d.key}: ")


@pytest.mark.parametrize("loss,low,high,c,agg", [
    ("gspo", 3e-4, 4e-4, None, "seq-mean-token-mean"),  # GSPO section 5.1
    ("cispo", 1.0, 5.0, None, "token-mean"),  # CISPO: no lower bound, 1 + 5 above (SkyRL's default)
])
def test_each_policy_loss_gets_its_papers_values(loss, low, high, c, agg):
    cfg, _ = derive(DAPOConfig(loss=LossConfig(policy_loss=loss)), on_gpu=False)
    assert (cfg.loss.clip_ratio_low, cfg.loss.clip_ratio_high, cfg.loss.clip_ratio_c, cfg.loss.loss_agg_mode) == \
        (low, high, c, agg)


def test_implied_values_partial_rollouts_adaptive_batches_and_dr_grpos_constant():
    trainer = TrainConfig(old_log_probs="trainer")
    cfg, derived = derive(DAPOConfig(rollout=RolloutConfig(engine="hf", partial=True, max_response_length=64),
                                     train=trainer, reward=SHORT,
                                     loss=LossConfig(loss_agg_mode="seq-mean-token-sum-norm"),
                                     algorithm=dataclasses.replace(DAPOConfig().algorithm,
                                                                   filter_groups=FilterGroupsConfig(adaptive=True)),
                                     eval=EvalConfig(max_response_length=32)), on_gpu=False)
    got = _lines(derived)
    assert cfg.rollout.partial_tokens == 16 and got["rollout.partial_tokens"] == (0, 16, False)  # a quarter
    assert cfg.algorithm.filter_groups.surplus == "carry"
    assert got["algorithm.filter_groups.surplus"][:2] == ("drop", "carry")
    assert cfg.algorithm.filter_groups.max_gen_prompts == 4 * cfg.data.gen_prompts_per_batch
    corr = cfg.algorithm.rollout_correction
    assert (corr.rollout_is, corr.rollout_is_threshold) == ("token", 2.0)  # verl's decoupled_token_is
    assert cfg.loss.loss_scale_factor == 64.0 and got["loss.loss_scale_factor"] == (None, 64.0, False)
    assert "eval.max_response_length" not in got and cfg.eval.max_response_length == 32  # given: kept


def test_a_users_choices_are_not_derived():
    chosen = DAPOConfig(loss=LossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=None,
                                        loss_agg_mode="token-mean"),
                        eval=EvalConfig(max_response_length=100))
    cfg, derived = derive(chosen, on_gpu=False)
    assert not {"loss.clip_ratio_low", "loss.clip_ratio_high", "loss.clip_ratio_c", "loss.loss_agg_mode",
                "eval.max_response_length"} & set(_lines(derived))
    assert (cfg.loss, cfg.eval) == (chosen.loss, chosen.eval)


def test_resolving_is_once_and_config_yaml_records_it(tmp_path):
    cfg, derived = derive(DAPOConfig(rollout=RolloutConfig(engine="hf", partial=True, max_response_length=64),
                                     train=TrainConfig(old_log_probs="trainer"), reward=SHORT), on_gpu=False)
    again, more = derive(cfg, on_gpu=False)
    assert again == cfg and all(d.kept for d in more)  # only the machine's, which the config keeps as auto
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg) + comments(derived))
    text = path.read_text()
    assert "# decided by this launch's machine" in text and "#   model.dtype: auto -> fp32" in text
    assert load_config(path) == cfg  # the comments keep it loadable, and it loads as what ran
    assert "clip_ratio_low: 0.2" in text and "rollout_is: token" in text


def test_pi_old_follows_from_the_rollouts_settings():
    """train.old_log_probs=auto: the engine's own log-probs where they are the step's pi_old (the HF
    engine at fp32 on the step's own weights), else the trainer's pass; so the demo's staleness alone
    is accepted. Where the dtype is the machine's, so is this choice: config.yaml keeps auto."""
    demo = load_config("conf/cpu_tiny.yaml")
    cfg, derived = derive(demo, on_gpu=False)
    assert cfg.train.old_log_probs == "auto" and _lines(derived)["train.old_log_probs"] == ("auto", "rollout", True)
    assert pi_old_source(cfg, on_gpu=False) == "rollout" and pi_old_source(cfg, on_gpu=True) == "trainer"  # bf16
    assert "train.old_log_probs: auto -> rollout" in comments(derived)
    fp32 = derive(load_config("conf/cpu_tiny.yaml", ["model.dtype=fp32"]), on_gpu=True)[0]
    assert fp32.train.old_log_probs == "rollout"  # the config decides it: recorded
    for overrides, why in ((["rollout.placement=separate", "rollout.num_ranks=1", "rollout.max_staleness=1"],
                            "rollout.max_staleness=1"),
                           (["rollout.partial=true"], "rollout.partial=true"),
                           (["rollout.engine=vllm"], "rollout.engine=vllm"),
                           (["model.dtype=bf16"], "bf16"),
                           (["algorithm.rollout_correction.rollout_rs=token_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"], "rollout correction")):
        cfg, derived = derive(load_config("conf/cpu_tiny.yaml", overrides), on_gpu=False)
        line = [d.line() for d in derived if d.key == "train.old_log_probs"]
        assert cfg.train.old_log_probs == "trainer" and why in line[0], (overrides, line)
    # an engine is exact by what its class declares, not by its name: the fault tests' stalling HF
    # engine is the HF engine's math, and a run with it must take the same pi_old as the demo's
    from tests.helpers.stalling_engine import register

    register()
    for name, want in (("stalling_hf", "rollout"), ("stalling_vllm", "trainer")):
        stalling = load_config("conf/cpu_tiny.yaml", [f"rollout.engine={name}"])
        assert pi_old_source(derive(stalling, on_gpu=False)[0], on_gpu=False) == want, name
    # a user's own value is kept, and a contradiction of it refused as before
    assert derive(load_config("conf/cpu_tiny.yaml", ["train.old_log_probs=trainer"]), on_gpu=False)[0] \
        .train.old_log_probs == "trainer"
    with pytest.raises(ValueError, match="train.old_log_probs=rollout"):
        load_config("conf/cpu_tiny.yaml", ["train.old_log_probs=rollout", "rollout.placement=separate",
                                           "rollout.num_ranks=1", "rollout.max_staleness=1"])
