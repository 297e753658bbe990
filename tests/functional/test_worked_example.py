"""``megatron-dapo example`` on the demo: every number it prints is checked against an independent
reference computed here from the responses it reports (the scorers called directly on each text,
the GRPO advantage formula written out with the standard library, the token-mean share by hand)."""

import statistics
import subprocess
import sys

import pytest

from megatron_dapo.reward import get_reward_fn
from tests.helpers.demo import CPU_TINY, ROOT, copy_demo_base

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example(demo_base, tmp_path_factory):
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
    from megatron_dapo.worked_example import run_example

    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("example") / "run")
    apply_cpu_compat()
    cfg = load_config(str(CPU_TINY), [f"logging.dir={run_dir}", "reward.fn=dapo_math"])
    return run_example(cfg, prompt_index=3), cfg


def test_every_number_follows_from_the_responses(example):
    ex, cfg = example
    assert len(ex.rows) == cfg.rollout.n
    value, paper = get_reward_fn("dapo_math"), get_reward_fn("math_dapo_paper")
    for r in ex.rows:
        assert r.score == value(r.text, ex.ground_truth)["score"]
        assert r.paper_score == paper(r.text, ex.ground_truth)["score"]
        assert r.reward == pytest.approx(r.score + r.overlong)
    rewards = [r.reward for r in ex.rows]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    for r in ex.rows:
        want = 0.0 if std == 0 else (r.reward - mean) / (std + cfg.algorithm.adv_eps)
        assert r.advantage == pytest.approx(want, abs=1e-6)
    assert ex.num_tokens == sum(r.num_tokens for r in ex.rows)  # no overlong filtering on the demo
    for r in ex.rows:  # ratio 1: the per-token loss is -A, summed over the response, over all tokens
        assert r.loss_share == pytest.approx(-r.advantage * r.num_tokens / ex.num_tokens, abs=1e-6)
    assert ex.loss == pytest.approx(sum(r.loss_share for r in ex.rows), abs=1e-6)


def test_the_command_prints_the_same_numbers(example, demo_base, tmp_path):
    ex, cfg = example
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "example", "--config", str(CPU_TINY),
                          f"logging.dir={run_dir}", "reward.fn=dapo_math", "--prompt", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert f"ground truth: {ex.ground_truth}" in lines
    shares = [float(line.split()[-1]) for line in lines if line.startswith("  ") and line.split()[0].isdigit()]
    assert shares == pytest.approx([r.loss_share for r in ex.rows], abs=1e-5)  # same seed, same responses
    assert any(line.startswith(f"loss ({cfg.loss_settings().loss_agg_mode} over the group's {ex.num_tokens} tokens")
               for line in lines)


def test_a_prompt_past_the_data_is_one_line(example, demo_base, tmp_path):
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "example", "--config", str(CPU_TINY),
                          f"logging.dir={run_dir}", "--prompt", "100000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("megatron-dapo: error: --prompt 100000: data.train_files has")


@pytest.mark.parametrize("override", ["loss.policy_loss=gspo", "loss.loss_agg_mode=seq-mean-token-mean",
                                      "algorithm.norm_adv_by_std_in_grpo=false"])
def test_a_loss_the_text_does_not_describe_is_refused_first(override):
    """Its formulas are DAPO's token-mean and GRPO's advantage: anything else is refused before any work."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.errors import InputError
    from megatron_dapo.worked_example import run_example

    with pytest.raises(InputError, match="walks through DAPO's loss"):
        run_example(load_config(CPU_TINY, [override]))
