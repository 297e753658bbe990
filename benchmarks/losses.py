"""DAPO's loss beside GSPO's and CISPO's in miniature, on a CPU: Table 1's task and protocol (benchmarks/table1.py),
its DAPO row (overlong filtering and soft punishment, dynamic sampling, no dual clip), the policy loss swapped.

Rows: the same run with loss.policy_loss = dapo, gspo, cispo, each at its paper's settings (the config's
"auto": dapo 0.2 / 0.28 token-mean; gspo 3e-4 / 4e-4 on the sequence ratio, seq-mean-token-mean;
cispo no lower bound, 1 + 5 above, token-mean). Nothing tuned: same seeds, starting model, data,
learning rate and generation budget for every row.

    python benchmarks/losses.py                  # 3 rows x 3 seeds, ~8 min on 2 idle cores
    python benchmarks/losses.py --seeds 1 --budget 2048   # a quick look

Writes <out>/losses.json (every run's numbers) and <out>/losses.md (the table docs/losses.md shows):
final held-out avg@k (the paper's rule), final entropy, and the clip fractions averaged over steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import table1  # noqa: E402  the task, the toy per seed, one run and its summary

DAPO_ROW = ["reward.overlong_filter=true", "reward.overlong_buffer.enable=true", "algorithm.filter_groups.enable=true"]
ROWS = [(name, [*DAPO_ROW, f"loss.policy_loss={name}"]) for name in ("dapo", "gspo", "cispo")]


def _clip_fractions(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "actor/pg_clipfrac_high" in r]
    return {key: statistics.fmean(r[f"actor/pg_clipfrac_{key}"] for r in steps) for key in ("high", "low")}


def measure(seeds: int, budget: int, jobs: int, out: Path) -> dict:
    start = time.perf_counter()
    seed_list = list(range(1, seeds + 1))
    with ThreadPoolExecutor(jobs) as pool:  # each job is a process; threads only wait
        preps = dict(zip(seed_list, pool.map(lambda s: table1._make_toy(s, out), seed_list)))
        work = [(name, row, seed) for seed in seed_list for name, row in ROWS]
        results = list(pool.map(lambda j: table1._run(*j, budget, out, preps[j[2]]), work))
    for r in results:
        r.update(_clip_fractions(out / "runs" / f"{table1._slug(r['row'])}_seed{r['seed']}"))
    return {"budget": budget, "jobs": jobs, "wall_s": time.perf_counter() - start, "runs": results}


def markdown(result: dict) -> str:
    runs, budget = result["runs"], result["budget"]
    k = runs[0]["k"]
    lines = [f"| policy loss | held-out avg@{k} (paper's rule) | final entropy | clipped above (mean over steps) | "
             "clipped below | steps |", "|---|---|---|---|---|---|"]
    for name, _ in ROWS:
        rs = [r for r in runs if r["row"] == name]
        col = lambda key: [r[key] for r in rs]  # noqa: E731
        lines.append(f"| {name} | {table1._mean_sd(col('avg_at_k'))} | {table1._mean_sd(col('entropy'))} | "
                     f"{table1._mean_sd(col('high'))} | {table1._mean_sd(col('low'))} | "
                     f"{statistics.fmean(col('steps')):.0f} |")
    seeds = sorted({r["seed"] for r in runs})
    lines.append(f"\nMean ± sample standard deviation over seeds {seeds}; every run stopped after {budget} generated "
                 f"responses. Wall time {result['wall_s'] / 60:.1f} min ({result['jobs']} runs at once).")
    return "\n".join(lines)


def figures(result: dict) -> list[dict]:
    """Each loss's final held-out avg@k (mean over seeds) against dapo's from the same run. No targets:
    at this scale the rows differ within the seeds' spread (docs/losses.md)."""
    runs = result["runs"]
    mean = {name: statistics.fmean(r["avg_at_k"] for r in runs if r["row"] == name) for name, _ in ROWS}
    k, seeds = runs[0]["k"], len({r["seed"] for r in runs})
    return [dict(figure=f"{name}: final held-out avg@{k} ({seeds} seed(s), {result['budget']} responses)",
                 value=mean[name], unit=f"avg@{k}", baseline_name=None if name == "dapo" else "dapo",
                 baseline=None if name == "dapo" else mean["dapo"],
                 ratio=None if name == "dapo" else mean[name] / mean["dapo"], target=None, met=None)
            for name, _ in ROWS]


# Quick: one seed, 640 responses a run (~2 min with the seed's toy base); full: the CLI's defaults.
QUICK = dict(seeds=1, budget=640, jobs=2)
FULL = dict(seeds=3, budget=10240, jobs=2)


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry, in a temporary directory: QUICK or FULL (see above)."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_losses_") as tmp:
        result = measure(size["seeds"], size["budget"], size["jobs"], Path(tmp))
    runs = [{k: v for k, v in r.items() if k not in ("curve", "entropy_curve")} for r in result["runs"]]
    return dict(name="losses", figures=figures(result), markdown=markdown(result), details=dict(result, runs=runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=FULL["seeds"], help="seeds 1..N per row")
    p.add_argument("--budget", type=int, default=FULL["budget"], help="generated responses per run")
    p.add_argument("--jobs", type=int, default=FULL["jobs"], help="runs at once (one thread each)")
    p.add_argument("--out", default="runs/losses", help="output dir; finished runs are reused on a rerun")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.seeds, args.budget, args.jobs, out)
    (out / "losses.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "losses.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
