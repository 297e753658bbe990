"""benchmarks/table1.py: its rows are the paper's Table 1 progression, one technique per row, on a task
where the length limit really cuts some reasoning responses and not others."""

import importlib.util
from pathlib import Path

import pytest

from megatron_dapo.config_loading import load_config, to_dict
from megatron_dapo.toy.base import max_response_tokens

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("table1", ROOT / "benchmarks" / "table1.py")
table1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table1)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("t1")
    return [(name, load_config(table1.CONFIG, table1._overrides(row, 1, 10240, run_dir)))
            for name, row in table1.rows()]


def test_first_row_is_grpo_and_last_is_dapo(configs):
    grpo, dapo = configs[0][1], configs[-1][1]
    grpo_loss, dapo_loss = grpo.loss_settings(), dapo.loss_settings()
    assert ((grpo_loss.clip_ratio_low, grpo_loss.clip_ratio_high, grpo_loss.loss_agg_mode)
            == (0.2, 0.2, "seq-mean-token-mean"))
    assert not grpo.algorithm.filter_groups.enable and not grpo.reward.overlong_buffer.enable
    assert not grpo.reward.overlong_filter
    assert (dapo_loss.clip_ratio_low, dapo_loss.clip_ratio_high, dapo_loss.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.algorithm.filter_groups.enable and dapo.reward.overlong_buffer.enable and dapo.reward.overlong_filter
    assert all(c.loss_settings().clip_ratio_c is None for _, c in configs)  # the paper has no dual clip


def test_each_row_adds_exactly_one_technique(configs):
    expected = ["reward.overlong_filter", "loss.clip_ratio_high", "reward.overlong_buffer.enable",
                "loss.loss_agg_mode", "algorithm.filter_groups.enable"]
    flat = [_flat(to_dict(c)) for _, c in configs]
    changed = [sorted(k for k in b if a[k] != b[k]) for a, b in zip(flat, flat[1:])]
    assert changed == [[k] for k in expected]


def test_every_row_runs_the_same_budget_and_a_limit_that_cuts_only_long_reasoning(configs):
    assert {c.train.generation_budget for _, c in configs} == {10240}
    cfg = configs[0][1]
    limit, toy = cfg.rollout.max_response_length, cfg.toy
    shortest_reasoning = toy.min_digits + 8  # "Check", " ", the digits, ".\n", "Answer", ":", " ", d, <|im_end|>
    assert shortest_reasoning <= limit < max_response_tokens(toy), "some reasoning fits, some is truncated"
    assert 5 <= limit and cfg.eval.max_response_length == limit  # a bare answer always fits; eval cuts alike
