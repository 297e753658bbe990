"""The refusals of a plan that does not fit (plan_checks.py): each names the knob that fixes it, and each
fix it names, applied and planned again, fits."""

import itertools
import math
import re
from pathlib import Path

import pytest

from megatron_dapo import cli
from megatron_dapo.config_loading import load_config
from megatron_dapo.convert.synthetic import QWEN3_CONFIGS, QWEN25_CONFIGS, SHAPES
from megatron_dapo.memory_plan import plan

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml"
QWEN32 = QWEN25_CONFIGS["32B"]
MIB = 2**20


def _paper(*overrides):
    return plan(load_config(PAPER, list(overrides)), QWEN32, 128)


def test_check_fits_names_offload_when_generating_binds_and_the_next_knob_once_it_is_on(capsys):
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B"]
    assert cli.main([*base, "rollout.gpu_memory_utilization=0.9"]) == 2
    err = capsys.readouterr().err
    assert "lower rollout.gpu_memory_utilization=0.9 to <= 0.74" in err
    assert "or set actor.offload_during_rollout=true (moves 11.3 GB" in err
    assert cli.main([*base, "rollout.gpu_memory_utilization=0.9", "actor.offload_during_rollout=true"]) == 2
    err = capsys.readouterr().err
    assert "to <= 0.88" in err and "set actor.offload_weights=true" in err
    h200 = [*base, "--gpu", "h200"]
    assert cli.main([*h200, "rollout.gpu_memory_utilization=0.9"]) == 2
    assert "to <= 0.85" in capsys.readouterr().err
    assert cli.main([*h200, "rollout.gpu_memory_utilization=0.85"]) == 0


def test_a_set_kv_cache_size_replaces_the_utilization_share(capsys):
    """rollout.kv_cache_memory_mb: vLLM's share is its weights + activations + that many MiB (it ignores
    gpu_memory_utilization then), and a layout that does not fit names that key."""
    r = _paper("rollout.kv_cache_memory_mb=20000").rollout
    assert r.share == r.weights + r.activations + 20000 * 2**20 and r.kv == 20000 * 2**20
    base = ["plan", "--config", str(PAPER), "--world-size", "128", "--shape", "32B"]
    assert cli.main([*base, "rollout.kv_cache_memory_mb=90000"]) == 2
    assert "lower rollout.kv_cache_memory_mb=90000 to <= 44000 (the trainer's state" in capsys.readouterr().err


def _generating_fits(cfg_overrides: list[str], shape: dict, world: int, gpu: str) -> bool:
    """The generating phase of that layout fits its GPU, and vLLM's KV cache holds one sequence."""
    result = plan(load_config(PAPER, cfg_overrides), shape, world, gpu=gpu)
    r = result.rollout
    return result.generating_bytes <= result.capacity_bytes and r.tokens(r.kv) >= r.max_sequence


def _applied(err: str, overrides: list[str], world: int, pp: int, least: str) -> list[tuple[list[str], int]]:
    """Each fix the message names, as (overrides, world size) to plan again; ``least``: the knob's value
    that holds the engine's floor (Plan.engine_floor)."""
    knob = "rollout.kv_cache_memory_mb" if "rollout.kv_cache_memory_mb" in err else "rollout.gpu_memory_utilization"
    fixes = []
    if m := re.search(rf"lower {knob}=[\d.]+ to <= ([\d.]+) \(", err):
        fixes.append(([*overrides, f"{knob}={m[1]}"], world))
    if m := re.search(r"set ((?:actor\.\w+=true(?: and )?)+) \((.*?)\)", err):
        value = re.search(r"(?:to <=|up to) ([\d.]+)", m[2])
        fixes.append(([*overrides, *m[1].split(" and "), *([f"{knob}={value[1]}"] if value else [])], world))
    if m := re.search(r"a larger TP x PP \(now \d+\).* about (\d+)x the GPUs", err):
        times = int(m[1])  # PP that many times larger, on that many times the GPUs, the engine at its floor
        fixes.append(([*overrides, f"parallel.pipeline_model_parallel_size={pp * times}", f"{knob}={least}"],
                      world * times))
    return fixes


def test_a_share_that_cannot_hold_the_engine_is_never_advised_and_each_fix_named_fits():
    """32B on one node at TP 8 x PP 1: the trainer's state leaves 0.08 of an H100 while vLLM generates, and
    the engine needs 0.23 for its weights and one sequence's KV cache, so no utilization fits: the message
    says so and names what makes room. Then, over shapes, layouts, shares and offload settings, every fix a
    refusal of the generating phase names, applied, fits that phase with a KV cache for one sequence."""
    from megatron_dapo.errors import ConfigError
    from megatron_dapo.plan_checks import check_fits

    from megatron_dapo.plan_report import format_plan

    one_node = ["parallel.pipeline_model_parallel_size=1"]
    result = plan(load_config(PAPER, one_node), QWEN32, 8)
    assert "without offload (utilization up to 0.08, under the 0.23 the engine needs)" in format_plan(result)
    with pytest.raises(ConfigError) as refused:
        check_fits(result, load_config(PAPER, one_node))
    err = str(refused.value)
    assert "to <= 0.08" not in err
    assert ("no rollout.gpu_memory_utilization fits: vLLM needs 19.1 GB per GPU (a utilization of 0.23: its weights "
            "at rollout TP 4 16.4 GB, activations 1.2 GB, the KV cache of one 22528-token sequence 1.5 GB) and 7.6 GB "
            "is left beside the trainer's state; set actor.offload_during_rollout=true "
            "(rollout.gpu_memory_utilization=0.7 then fits) or spread the trainer over more GPUs with a larger TP x PP "
            "(now 8): its 73.7 GB per GPU resident while vLLM generates must come down to 62.2 GB, about 2x the "
            "GPUs") in err
    whole = ["parallel.pipeline_model_parallel_size=1", "rollout.tensor_parallel_size=1"]  # 65.5 GB of engine weights
    with pytest.raises(ConfigError) as refused:
        check_fits(plan(load_config(PAPER, whole), QWEN32, 8, capacity_gb=60), load_config(PAPER, whole))
    assert str(refused.value).endswith(
        "vLLM needs 74.2 GB per GPU (more than the whole GPU: its weights at rollout TP 1 65.5 GB, activations 2.7 GB, "
        "the KV cache of one 22528-token sequence 5.9 GB) and 0.0 GB is left beside the trainer's state; raise "
        "rollout.tensor_parallel_size=1 (the engine's weights, 65.5 GB per GPU, shrink in proportion) or use GPUs "
        "with more memory")  # no offload named: the engine alone does not fit
    checked = 0
    knobs = (["rollout.gpu_memory_utilization=0.5"], ["rollout.gpu_memory_utilization=0.9"],
             ["rollout.kv_cache_memory_mb=30000"])
    offloads = ([], ["actor.offload_during_rollout=true"],
                ["actor.offload_during_rollout=true", "actor.offload_weights=true"])
    for shape, (world, pp), knob, offload in itertools.product(
            (QWEN32, QWEN3_CONFIGS["Qwen3-32B"]), ((8, 1), (16, 1), (16, 2)), knobs, offloads):
        overrides = [f"parallel.pipeline_model_parallel_size={pp}", *knob, *offload]
        cfg = load_config(PAPER, overrides)
        result = plan(cfg, shape, world)
        if result.generating_bytes <= result.capacity_bytes or result.generating_gb < result.training_gb:
            continue  # fits, or the training phase is the one refused
        with pytest.raises(ConfigError) as refused:
            check_fits(result, cfg)
        err = str(refused.value)
        if "no rollout." in err:
            assert result.beside_engine(offload=cfg.actor.offload_during_rollout,
                                        offload_weights=cfg.actor.offload_weights) + result.engine_floor > (
                result.capacity_bytes), err
        r = result.rollout
        least = (str(math.ceil((result.engine_floor - r.weights - r.activations) / MIB))
                 if cfg.rollout.kv_cache_memory_mb else f"{result.least_utilization:.2f}")
        fixes = _applied(err, overrides, world, pp, least)
        assert fixes, err
        for fix, fix_world in fixes:
            assert _generating_fits(fix, shape, fix_world, "h100"), (err, fix, fix_world)
            checked += 1
    assert checked >= 20


def test_activations_that_do_not_fit_name_context_parallelism_when_one_sequence_is_the_micro_batch(capsys):
    """A 43k-token sequence as the micro-batch, without recompute, at the paper's 128 GPUs: the refusal names
    CP (DP 8 halves), and CP 2 then fits; a mixture-of-experts model at 64k-token responses is offered it too,
    and fits at CP 8 (its experts over EP 8 of DP x CP 16)."""
    from megatron_dapo.errors import ConfigError
    from megatron_dapo.plan_checks import check_fits

    long = ["rollout.max_response_length=40960", "train.max_tokens_per_micro_batch=43008", "model.recompute=none"]
    cfg = load_config(PAPER, long)
    with pytest.raises(ConfigError) as refused:
        check_fits(plan(cfg, QWEN32, 128), cfg)
    message = str(refused.value)
    assert "while training" in message and "set model.recompute=full" in message
    assert "raise parallel.context_parallel_size=1 to 2 (each rank then holds 1/2 of every sequence)" in message
    assert "max_tokens_per_micro_batch" not in message  # one sequence already: nothing smaller to advise
    fixed = load_config(PAPER, [*long, "parallel.context_parallel_size=2"])
    check_fits(plan(fixed, QWEN32, 128), fixed)

    moe = ROOT / "conf/recipes/dapo-qwen3-30b-a3b-math-4n8g-pp2ep8.v1.yaml"
    cfg = load_config(moe, ["rollout.max_response_length=65536", "train.max_tokens_per_micro_batch=67584",
                            "model.recompute=none"])
    with pytest.raises(ConfigError) as refused:
        check_fits(plan(cfg, SHAPES["Qwen3-30B-A3B"], 32), cfg)
    assert "raise parallel.context_parallel_size=1 to 2" in str(refused.value)
    assert "recompute=full" in str(refused.value)
    fixed = load_config(moe, ["rollout.max_response_length=65536", "train.max_tokens_per_micro_batch=67584",
                              "model.recompute=none", "parallel.context_parallel_size=8"])
    check_fits(plan(fixed, SHAPES["Qwen3-30B-A3B"], 32), fixed)
