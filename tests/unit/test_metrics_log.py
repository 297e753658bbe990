"""MetricsLogger: JSONL records, TensorBoard events, timers, resume without duplicate steps."""

import json
import logging
import math
import sys

import pytest
import torch

from megatron_dapo.metrics_log import MetricsLogger, format_progress, progress_keys, read_metrics, to_floats


def make_logger(run_dir, *, start_step=0, tensorboard=False, enabled=True, wandb=False):
    return MetricsLogger(run_dir, tensorboard=tensorboard, wandb=wandb, wandb_project="test",
                         config={"lr": 1e-3}, enabled=enabled, start_step=start_step)


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_valid_json_line_per_step_written_before_close(tmp_path):
    log = make_logger(tmp_path)
    log.log(0, {"actor/loss": torch.tensor(0.5), "reward/acc_mean": 0.25, "count": 3})
    log.log(1, {"actor/loss": torch.tensor(float("nan")), "actor/entropy": torch.tensor([1.5])})
    records = lines(tmp_path)  # flushed on every write: readable while the logger is open
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["actor/loss"] == 0.5 and records[0]["reward/acc_mean"] == 0.25
    assert records[0]["count"] == 3
    assert records[1]["actor/loss"] is None  # NaN is not JSON
    assert records[1]["actor/entropy"] == 1.5
    assert all("time" in r for r in records)
    log.close()


def test_tensor_metrics_become_floats_in_order():
    values = to_floats({"b": torch.tensor(2.0, dtype=torch.bfloat16), "a": 1, "c": torch.tensor(3)})
    assert list(values) == ["b", "a", "c"] and values == {"b": 2.0, "a": 1.0, "c": 3.0}
    assert all(type(v) is float for v in values.values())
    with pytest.raises(ValueError, match="scalar"):
        to_floats({"x": torch.ones(2)})


def test_timers_accumulate_per_step_and_reset(tmp_path):
    log = make_logger(tmp_path)
    for _ in range(2):
        with log.timer("gen"):
            sum(range(10000))
    values = log.log(0, {})
    assert values["timing_s/gen"] > 0
    assert "timing_s/gen" not in log.log(1, {})
    log.close()
    assert lines(tmp_path)[0]["timing_s/gen"] == pytest.approx(values["timing_s/gen"])


def test_tensorboard_event_files_are_written(tmp_path):
    with make_logger(tmp_path, tensorboard=True) as log:
        log.log(0, {"reward/acc_mean": 0.1})
        log.log(1, {"reward/acc_mean": 0.2})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_resume_drops_the_steps_that_will_run_again(tmp_path):
    with make_logger(tmp_path) as log:
        for step in range(5):
            log.log(step, {"x": step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "x": 5')  # a line cut short by a crash
    with make_logger(tmp_path, start_step=3) as log:
        assert [r["step"] for r in lines(tmp_path)] == [0, 1, 2]
        log.log(3, {"x": 30})
        log.log(4, {"x": 40})
    records = lines(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[3]["x"] == 30


def test_fresh_run_starts_an_empty_file(tmp_path):
    with make_logger(tmp_path) as log:
        log.log(0, {"x": 1})
    with make_logger(tmp_path) as log:
        log.log(0, {"x": 2})
    assert [r["x"] for r in lines(tmp_path)] == [2]


def test_disabled_logger_writes_nothing_but_still_times(tmp_path):
    run_dir = tmp_path / "rank1"
    log = make_logger(run_dir, enabled=False, tensorboard=True)
    with log.timer("step"):
        pass
    values = log.log(0, {"x": torch.tensor(1.0)})
    assert values["x"] == 1.0 and "timing_s/step" in values
    log.close()
    assert not run_dir.exists()


def test_wandb_missing_is_a_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.metrics_log"):
        with make_logger(tmp_path, wandb=True) as log:
            log.log(0, {"x": 1.0})
    assert "wandb is not installed" in caplog.text
    assert lines(tmp_path)[0]["x"] == 1.0


def test_progress_line_is_compact_and_skips_missing_keys():
    values = {"reward/acc_mean": 0.53125, "timing_s/step": 1.4321, "eval/avg@4": 0.8, "eval/avg@2": 0.1}
    line = format_progress(7, values, total_steps=120, keys=progress_keys(4))
    assert line == "step   7/120 | eval_acc 0.800 | acc 0.531 | s 1.432"  # avg@4: the run's eval.n
    assert "nan" in format_progress(1, {"reward/acc_mean": math.nan}, total_steps=1)


def test_progress_line_labels_the_logprob_agreement_as_a_ratio():
    """rollout/logprob_mismatch is 1.0 when engine and trainer agree: its column must not read as a
    share of mismatched tokens ("mismatch 1.000" read as 100%)."""
    line = format_progress(3, {"rollout/logprob_mismatch": 1.0004}, total_steps=10)
    assert line == "step  3/10 | eng/trn 1.000", line
    assert "mismatch" not in " ".join(label for _, label in progress_keys(4))


def test_read_metrics_skips_a_broken_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    assert read_metrics(path) == [{"step": 0, "x": 1}]
