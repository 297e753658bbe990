"""megatron_dapo/plotting.py (tools/plot_metrics.py's CLI): a PNG from a small metrics.jsonl; missing keys are skipped."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from megatron_dapo import plotting as plot_metrics  # noqa: E402  (after the importorskip)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def metrics_path(tmp_path):
    records = []
    for step in range(12):
        r = {"step": step, "time": 1000.0 + step, "reward/acc_mean": step / 12,
             "response_length/mean": 5 + step % 3, "response_length/max": 9, "actor/entropy": 1 / (step + 1),
             "actor/pg_clipfrac_high": 0.01,
             "dynamic_sampling/num_gen_batches": 1 + step // 6, "timing_s/step": 0.5, "actor/pg_loss": None}
        if step % 4 == 0:
            r["eval/acc_mean"] = step / 12
        records.append(r)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 12, "reward/acc')
    return path


def test_writes_a_png_grid(metrics_path, tmp_path, capsys):
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    # Seven of the eight default panels have data here; the mismatch panel has none and is skipped.
    assert "(7 panels)" in capsys.readouterr().out


def test_selected_keys_and_globs(metrics_path, tmp_path):
    out = tmp_path / "two.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out),
                              "--keys", "eval/acc_mean", "response_length/*", "not/there"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_only_missing_keys_is_an_error(metrics_path, tmp_path, capsys):
    out = tmp_path / "none.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out), "--keys", "not/there"]) == 1
    assert not out.exists()
    assert "reward/acc_mean" in capsys.readouterr().err


def test_series_skip_nulls_and_broken_lines(metrics_path):
    series = plot_metrics.load_series(metrics_path)
    assert "actor/pg_loss" not in series and "time" not in series
    steps, values = series["eval/acc_mean"]
    assert steps == [0, 4, 8] and values == [0.0, 4 / 12, 8 / 12]
    assert series["reward/acc_mean"][0] == list(range(12))
