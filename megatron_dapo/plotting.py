"""Plot a run's metrics.jsonl as a grid of training curves, like the DAPO paper's figures.

    python tools/plot_metrics.py --metrics runs/x/metrics.jsonl --out curves.png [--keys K ...]

(the CLI is ``main`` below; training calls ``plot_run`` in-process at the end of a run.)

Default panels (paper Fig. 1, 2, 6, 7 and section 4.3's advice to watch length and entropy next to
validation accuracy), each with at most ``MAX_LINES`` lines so that a glance reads them:
held-out accuracy (avg@n by both scorers and pass@n, n the largest k logged), training reward and
accuracy, response length (mean and max), entropy, clip fractions, dynamic-sampling counts,
rollout/trainer log-prob mismatch, time per step (the total and the three largest phases) and the
alarm fractions (the largest ones). A panel's selector picks its keys from what the file holds;
keys that are absent are skipped, and so are panels left empty, so any subset of metrics plots.
``panel_keys`` returns the choice without drawing (the tests read it). ``--keys`` (globs too)
replaces the defaults with one panel per argument, each drawing every key it matches. Metrics
logged only on some steps (evaluation) are drawn with markers at those steps.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

Series = dict[str, tuple[list[int], list[float]]]
Selector = Callable[[Series], list[str]]  # the keys a panel draws, from what the file holds

# More lines than this in one panel and nobody reads the legend: each default panel keeps its few.
MAX_LINES = 4
_AVG_AT = re.compile(r"^eval/avg@(\d+)$")


def globs(*patterns: str, limit: int | None = MAX_LINES) -> Selector:
    """A selector of the keys matching ``patterns`` (see ``select``), the first ``limit`` of them."""
    return lambda series: select(series, patterns)[:limit]


def held_out(series: Series) -> list[str]:
    """avg@n by both scorers and pass@n at the largest n logged: the number to set beside the
    paper's, its check by the second scorer, and the ceiling (cons@n stays in metrics.jsonl)."""
    ns = [int(m.group(1)) for m in map(_AVG_AT.match, series) if m]
    if not ns:
        return select(series, ("val*/acc*",))[:MAX_LINES]
    n = max(ns)
    return [k for k in (f"eval/avg@{n}", f"eval/avg@{n}_value", f"eval/pass@{n}") if k in series]


def timing(series: Series) -> list[str]:
    """The step's total and the three phases that took the most time over the run: where the time
    goes; the small phases only clutter the panel."""
    total = [k for k in ("timing_s/step",) if k in series]
    phases = [k for k in select(series, ("timing_s/*",)) if k not in total]
    phases.sort(key=lambda k: -sum(series[k][1]))
    return total + phases[:MAX_LINES - 1]


def alarms(series: Series) -> list[str]:
    """The alarm fractions (alarm/* with every value in [0, 1]) with the highest peaks: the ones
    that came closest to, or crossed, their thresholds."""
    keys = [k for k in select(series, ("alarm/*",)) if all(0 <= v <= 1 for v in series[k][1])]
    keys.sort(key=lambda k: -max(series[k][1]))
    return keys[:MAX_LINES]


# (panel title, selector). Names follow the metric names of the training loop.
PANELS: tuple[tuple[str, Selector], ...] = (
    ("Held-out accuracy", held_out),
    ("Train reward", globs("reward/acc_mean", "reward/score_mean", "reward/overlong_penalty_mean")),
    ("Response length (tokens)",
     globs("response_length/mean", "response_length/max", "eval/response_length_mean")),
    ("Entropy", globs("actor/entropy*")),
    ("Clip fractions", globs("actor/pg_clipfrac*", "response_length/clip_ratio")),
    ("Dynamic sampling", globs("dynamic_sampling/num_gen_batches", "dynamic_sampling/num_groups_kept",
                               "dynamic_sampling/num_dropped_*")),
    ("Log-prob mismatch", globs("rollout/logprob_mismatch*")),
    ("Time per step (s)", timing),
    ("Alarms", alarms),
)


def load_series(path: str | Path) -> Series:
    """key -> (steps, values) from a metrics.jsonl; nulls, non-numbers and broken lines skipped.

    A step logged twice (a resumed run whose file was not truncated) keeps its last value.
    """
    by_key: dict[str, dict[int, float]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_key.items()}


def select(series_keys, patterns) -> list[str]:
    """Keys matching any pattern, in pattern order, each once."""
    out: list[str] = []
    for pattern in patterns:
        out += [k for k in sorted(series_keys) if fnmatch.fnmatchcase(k, pattern) and k not in out]
    return out


def panel_keys(series: Series, panels=PANELS) -> list[tuple[str, list[str]]]:
    """(title, keys) of each panel that has something to draw, in order: what ``plot`` draws,
    testable without reading pixels."""
    filled = [(name, selector(series)) for name, selector in panels]
    return [(name, keys) for name, keys in filled if keys]


def plot(series: Series, panels, out: str | Path, *, title: str) -> int:
    """Draws the non-empty panels into ``out``; returns how many were drawn.

    Every finished or stopped run draws this before it exits (in a stop, inside the grace period),
    so it is drawn once, onto an Agg canvas without pyplot, with the grid's margins set by hand
    (tight_layout draws the whole figure a second time to measure it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    filled = panel_keys(series, panels)
    if not filled:
        return 0
    num_cols = min(3, len(filled))
    num_rows = math.ceil(len(filled) / num_cols)
    width, height = 5.2 * num_cols, 3.4 * num_rows
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    # margins in inches, whatever the grid's size: room for tick labels, titles and the suptitle
    fig.subplots_adjust(left=0.55 / width, right=1 - 0.2 / width, bottom=0.45 / height, top=1 - 0.75 / height,
                        wspace=0.25, hspace=0.4)
    axes = fig.subplots(num_rows, num_cols, squeeze=False)
    max_step = max(max(steps) for steps, _ in series.values())
    for ax, (name, keys) in zip(axes.flat, filled):
        for key in keys:
            steps, values = series[key]
            sparse = len(steps) < 0.5 * (max_step + 1)  # evaluation-style metric: show the points
            ax.plot(steps, values, marker="o" if sparse else None, markersize=3, linewidth=1.2, label=key)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8, labelpad=1)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(filled):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return len(filled)


def plot_run(run_dir: str | Path) -> Path | None:
    """<run_dir>/curves.png from its metrics.jsonl with the default panels; None if nothing to
    plot or matplotlib is missing (a plot is never worth failing a finished run for)."""
    run_dir = Path(run_dir)
    try:
        series = load_series(run_dir / "metrics.jsonl")
        if series and plot(series, PANELS, run_dir / "curves.png", title=str(run_dir / "metrics.jsonl")):
            return run_dir / "curves.png"
    except (ImportError, OSError) as e:
        print(f"megatron-dapo: no curves.png ({e})", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl training curves to a PNG.")
    parser.add_argument("--metrics", required=True, help="path to a run's metrics.jsonl")
    parser.add_argument("--out", required=True, help="output image (.png)")
    parser.add_argument("--keys", nargs="+",
                        help="metric keys or globs, one panel each (default: the standard grid)")
    args = parser.parse_args(argv)
    series = load_series(args.metrics)
    if not series:
        print(f"no numeric metrics in {args.metrics}", file=sys.stderr)
        return 1
    panels = [(k, globs(k, limit=None)) for k in args.keys] if args.keys else PANELS
    num_drawn = plot(series, panels, args.out, title=str(args.metrics))
    if not num_drawn:
        print(f"none of the requested keys are in {args.metrics}; it has: {', '.join(sorted(series))}",
              file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({num_drawn} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
