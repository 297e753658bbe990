"""benchmarks/peer_trl.py: both sides get the same work, TRL's reward is ours, and TRL's side runs.

The benchmark's numbers mean something only if the two commands describe the same job; these
tests read each side's settings back through its own parser (our config loader, the TRL side's
argparse) and compare them, check the TRL reward against the overlong formula worked by hand, and
run TRL's side for two steps on the demo's base (skipped without the `peer` extra)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config_loading import load_config
from tests.helpers.demo import LAUNCHER_VARS, copy_demo_base

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _peer_trl_side as trl_side  # noqa: E402
import peer_trl  # noqa: E402


def _sides(tmp_path):
    s = peer_trl.Settings()
    args = s.ours(1)
    cfg = load_config(args[1], args[2:] + [f"logging.dir={tmp_path}"])
    return s, cfg, trl_side.parse(s.trl(1, tmp_path, tmp_path / "out"))


def test_both_sides_describe_the_same_job(tmp_path):
    s, cfg, trl = _sides(tmp_path)
    assert (cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.max_response_length) == \
        (trl.prompts_per_step, trl.group_size, trl.max_tokens) == (16, 8, 16)
    # updates per step: ours from the mini-batch size, TRL's from steps_per_generation
    assert cfg.data.prompts_per_step // cfg.train.mini_batch_prompts == trl.updates_per_step == 4
    assert cfg.optim.lr == trl.lr and cfg.optim.lr_warmup_steps * trl.updates_per_step == trl.warmup_updates
    loss = cfg.loss_settings()
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c, cfg.optim.clip_grad) == \
        (trl.clip_low, trl.clip_high, trl.clip_c, trl.clip_grad)
    shaping = cfg.reward.overlong_buffer
    assert shaping.enable and (shaping.len, shaping.penalty_factor) == (trl.buffer_len, trl.penalty_factor)
    assert cfg.optim.weight_decay == 0.0 and cfg.num_threads == trl.threads == 1
    # what the comparison turns off on our side, because TRL has none of it
    assert not cfg.algorithm.filter_groups.enable and cfg.eval.every == 0 and not cfg.eval.before_train
    assert cfg.data.gen_prompts_per_batch == cfg.data.prompts_per_step and cfg.reward.fn == "math_dapo_paper"


def test_trls_reward_is_our_paper_score_plus_the_overlong_penalty_by_hand(tmp_path):
    """L_max 16, buffer 4: no penalty up to 12 tokens, -(len - 12) / 4 beyond."""
    _, _, trl = _sides(tmp_path)
    reward = trl_side.reward_fn(trl)
    out = reward(prompts=None, completions=["Answer: 8", "Answer: 3", [{"content": "Answer: 8"}]],
                 completion_ids=[[0] * 5, [0] * 14, [0] * 16], ground_truth=["8", "8", "8"])
    assert out == pytest.approx([1.0, -1.0 - 0.5, 1.0 - 1.0])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed: ./install.sh peer")
def test_trls_side_trains_two_steps_on_the_demo_base_and_reports(tmp_path, demo_base):
    inputs = copy_demo_base(demo_base, tmp_path / "inputs")
    s = peer_trl.Settings(steps=2, seeds=(1,), dp2=False)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/_peer_trl_side.py"),
                          *s.trl(1, inputs, tmp_path / "trl")], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("PEER_RESULT ")).split(" ", 1)[1])
    assert len(result["step_seconds"]) == 2 and len(result["generate_seconds"]) == 2  # one generation a step
    assert 0.0 <= result["eval"]["acc_mean"] <= 1.0 and result["eval"]["format_rate"] > 0.5  # the base's format
    assert result["peak_rss_mb"] > 100
