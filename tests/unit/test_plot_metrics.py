"""megatron_dapo/plotting.py (tools/plot_metrics.py's CLI): a PNG from a small metrics.jsonl; missing keys are
skipped."""

import json

import pytest

pytest.importorskip("matplotlib")

from megatron_dapo import plotting as plot_metrics  # noqa: E402  (after the importorskip)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def drawn(monkeypatch):
    """What each saved figure showed: per visible panel (title, [(label, x, y, marker)]), read off
    the figure as it is saved; a PNG's bytes alone cannot tell a skipped key from a drawn one."""
    from matplotlib.figure import Figure

    figures = []
    real_savefig = Figure.savefig

    def savefig(fig, *args, **kwargs):
        figures.append([(ax.get_title(), [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()),
                                           line.get_marker()) for line in ax.get_lines()])
                        for ax in fig.axes if ax.get_visible()])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _panels(figure):
    return [(title, [label for label, *_ in lines]) for title, lines in figure]


@pytest.fixture
def metrics_path(tmp_path):
    records = []
    for step in range(12):
        r = {"step": step, "time": 1000.0 + step, "reward/acc_mean": step / 12,
             "response_length/mean": 5 + step % 3, "response_length/max": 9, "actor/entropy": 1 / (step + 1),
             "actor/pg_clipfrac_high": 0.01,
             "dynamic_sampling/num_gen_batches": 1 + step // 6, "timing_s/step": 0.5, "actor/pg_loss": None}
        if step % 4 == 0:
            r["eval/avg@4"] = step / 12
        records.append(r)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 12, "reward/acc')
    return path


def test_writes_a_png_grid(metrics_path, tmp_path, capsys, drawn):
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    # Seven of the nine default panels have data here; the mismatch and alarm panels have none and are
    # skipped, and so are the keys of the others the file lacks (reward/score_mean) or holds only as null.
    assert "(7 panels)" in capsys.readouterr().out
    (figure,) = drawn
    assert _panels(figure) == [
        ("Held-out accuracy", ["eval/avg@4"]),
        ("Train reward", ["reward/acc_mean"]),
        ("Response length (tokens)", ["response_length/mean", "response_length/max"]),
        ("Entropy", ["actor/entropy"]),
        ("Clip fractions", ["actor/pg_clipfrac_high"]),
        ("Dynamic sampling", ["dynamic_sampling/num_gen_batches"]),
        ("Time per step (s)", ["timing_s/step"]),
    ]
    lines = {label: (x, y, marker) for _, panel in figure for label, x, y, marker in panel}
    # Evaluation is logged every fourth step: drawn as points at those steps; every-step keys as lines.
    assert lines["eval/avg@4"] == ([0, 4, 8], [0.0, 4 / 12, 8 / 12], "o")
    assert lines["reward/acc_mean"] == (list(range(12)), [s / 12 for s in range(12)], "None")


def test_selected_keys_and_globs(metrics_path, tmp_path, capsys, drawn):
    out = tmp_path / "two.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out),
                              "--keys", "eval/avg@4", "response_length/*", "not/there"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    # One panel per argument; the glob's matches in sorted order; the missing key's panel skipped.
    assert "(2 panels)" in capsys.readouterr().out
    (figure,) = drawn
    assert _panels(figure) == [("eval/avg@4", ["eval/avg@4"]),
                               ("response_length/*", ["response_length/max", "response_length/mean"])]


def test_only_missing_keys_is_an_error(metrics_path, tmp_path, capsys):
    out = tmp_path / "none.png"
    assert plot_metrics.main(["--metrics", str(metrics_path), "--out", str(out), "--keys", "not/there"]) == 1
    assert not out.exists()
    assert "reward/acc_mean" in capsys.readouterr().err


def test_series_skip_nulls_and_broken_lines(metrics_path):
    series = plot_metrics.load_series(metrics_path)
    assert "actor/pg_loss" not in series and "time" not in series
    steps, values = series["eval/avg@4"]
    assert steps == [0, 4, 8] and values == [0.0, 4 / 12, 8 / 12]
    assert series["reward/acc_mean"][0] == list(range(12))


@pytest.fixture
def busy_metrics(tmp_path):
    """What a real run logs: eval at k = 1 and 4 by both scorers (12 held-out keys), eight timing
    phases, six alarm metrics, five dynamic-sampling counts."""
    records = []
    for step in range(10):
        phases = {"rollout": 5.0, "train": 3.0, "old_log_probs": 1.0, "weight_sync": 0.5, "save": 0.1,
                  "ref": 0.2, "sleep": 0.05}
        r = {"step": step, "timing_s/step": 10.0, **{f"timing_s/{k}": v for k, v in phases.items()},
             "alarm/scorer_disagreement": 0.02, "alarm/repeated_answer_label": 0.3 if step == 7 else 0.0,
             "alarm/no_answer_line": 0.1, "alarm/identical_groups": 0.0, "alarm/all_correct": 0.6,
             "alarm/shortcut_fallbacks": 3.0,  # a count, not a fraction: off the fraction panel
             **{f"dynamic_sampling/{k}": 1.0 for k in ("num_gen_batches", "num_groups_kept",
                                                       "num_dropped_all_correct", "num_dropped_all_wrong",
                                                       "num_dropped_other")}}
        if step % 3 == 0:
            r["timing_s/eval"] = 4.0  # 16 s over four steps: more than old_log_probs' 10 s over ten
            for key in ("avg@1", "avg@4", "pass@1", "pass@4", "cons@1", "cons@4"):
                r[f"eval/{key}"] = r[f"eval/{key}_value"] = step / 10
        records.append(r)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_default_panels_keep_a_few_lines(busy_metrics):
    chosen = dict(plot_metrics.panel_keys(plot_metrics.load_series(busy_metrics)))
    assert chosen["Held-out accuracy"] == ["eval/avg@4", "eval/avg@4_value", "eval/pass@4"]
    # The total first, then the phases by time spent over the run.
    assert chosen["Time per step (s)"] == ["timing_s/step", "timing_s/rollout", "timing_s/train",
                                           "timing_s/eval"]
    # Fractions only, by peak; the largest four of five.
    assert chosen["Alarms"] == ["alarm/all_correct", "alarm/repeated_answer_label", "alarm/no_answer_line",
                                "alarm/scorer_disagreement"]
    assert len(chosen["Dynamic sampling"]) == plot_metrics.MAX_LINES == 4
    assert all(len(keys) <= plot_metrics.MAX_LINES for keys in chosen.values())


def test_drawn_lines_per_panel(busy_metrics, tmp_path, drawn):
    """What the figure holds (matplotlib's Axes lines), not only what panel_keys chose."""
    assert plot_metrics.plot_run(busy_metrics.parent) == busy_metrics.parent / "curves.png"
    (figure,) = drawn
    counts = {title: len(lines) for title, lines in figure}
    assert counts == {"Held-out accuracy": 3, "Dynamic sampling": 4, "Time per step (s)": 4, "Alarms": 4}


def test_held_out_falls_back_and_timing_without_total():
    series = {"val/acc_mean": ([0], [0.5]), "timing_s/rollout": ([0], [1.0]), "timing_s/train": ([0], [2.0])}
    chosen = dict(plot_metrics.panel_keys(series))
    assert chosen["Held-out accuracy"] == ["val/acc_mean"]
    assert chosen["Time per step (s)"] == ["timing_s/train", "timing_s/rollout"]
    assert "Alarms" not in chosen  # no alarm/* keys: no panel


def test_keys_argument_is_not_capped(busy_metrics, tmp_path, drawn):
    """--keys draws every match: asking for a glob is asking for all of it."""
    out = tmp_path / "all_eval.png"
    assert plot_metrics.main(["--metrics", str(busy_metrics), "--out", str(out), "--keys", "eval/*"]) == 0
    (figure,) = drawn
    every = sorted(f"eval/{k}{s}" for k in ("avg@1", "avg@4", "pass@1", "pass@4", "cons@1", "cons@4")
                   for s in ("", "_value"))
    assert _panels(figure) == [("eval/*", every)]
