"""Rollout corrections in miniature, on a CPU: token TIS against sequence IS against IcePop, where the
rollouts really are off-policy.

The task, protocol and DAPO row are benchmarks/losses.py's (Table 1's task, dapo loss), run in the
separate placement at staleness 1 with partial rollouts: torchrun with 2 processes, rank 0 trains and
rank 1 holds the engine; the next step's first batch generates while this step trains, and a
generation batch extends a response by at most PIECE tokens, so a long response is written by two or
three weight versions. pi_old is the trainer's (train.old_log_probs=trainer), one or more updates
ahead of the weights that sampled: the correction has something to correct.

Rows (verl 0.9.1's presets of the same names, algorithm.rollout_correction):
  token TIS     rollout_is=token,    rollout_is_threshold=2.0       (decoupled_token_is; our async default)
  sequence IS   rollout_is=sequence, rollout_is_threshold=2.0       (decoupled_seq_is)
  IcePop        rollout_is=token,    rollout_is_threshold=0.5_5.0   (decoupled_token_icepop)
There is no row without a correction: a stale or partial run always corrects (config_derived.py).

    python benchmarks/rollout_corrections.py                 # 3 rows x 3 seeds, ~30 min on 2 idle cores
    python benchmarks/rollout_corrections.py --seeds 1 --budget 2048   # a quick look

Writes <out>/rollout_corrections.json (every run's numbers) and <out>/rollout_corrections.md (the table
docs/losses.md shows): final held-out avg@k (the paper's rule), final entropy, and per step, averaged
over steps: the mismatch the correction saw (KL of the rollout policy from pi_old, token chi-square),
the weights' spread (std, effective sample size as a fraction), the fractions of tokens whose raw
weight lies above the upper bound (truncated to it by TIS, zeroed by IcePop) and below the lower one
(zeroed by IcePop; for TIS 1 / cap, reported and kept), and the mean weight-version lag of the
trained samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import table1  # noqa: E402  the task, the toy per seed, one run and its summary
from losses import DAPO_ROW  # noqa: E402

PIECE = 7  # tokens a generation batch extends a response by: two batches for Table 1's 14-token limit (a divisor)
ASYNC = ["rollout.placement=separate", "rollout.num_ranks=1", "rollout.max_staleness=1", "rollout.partial=true",
         f"rollout.partial_tokens={PIECE}", "train.old_log_probs=trainer"]
CORR = "algorithm.rollout_correction"
ROWS = [
    ("token TIS", [f"{CORR}.rollout_is=token", f"{CORR}.rollout_is_threshold=2.0"]),
    ("sequence IS", [f"{CORR}.rollout_is=sequence", f"{CORR}.rollout_is_threshold=2.0"]),
    ("IcePop", [f"{CORR}.rollout_is=token", f"{CORR}.rollout_is_threshold=0.5_5.0"]),
]
PER_STEP = {  # column -> how a step's record gives it
    "kl": lambda r: r["rollout_corr/kl"],
    "chi2": lambda r: r["rollout_corr/chi2_token"],
    "is_std": lambda r: r["rollout_corr/is_std"],
    "ess": lambda r: r["rollout_corr/ess"],
    "above": lambda r: r["rollout_corr/is_frac_high"],
    "below": lambda r: r["rollout_corr/is_frac_low"],
    "lag": lambda r: r["rollout/version_lag_mean"],
}


def _per_step(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "rollout_corr/kl" in r]
    return {key: statistics.fmean(get(r) for r in steps) for key, get in PER_STEP.items()}


def measure(seeds: int, budget: int, out: Path) -> dict:
    """Every row at seeds 1..N, one run at a time (each run is two processes); finished runs are reused."""
    start = time.perf_counter()
    results = []
    for seed in range(1, seeds + 1):
        prep = table1._make_toy(seed, out)
        for name, row in ROWS:
            print(f"rollout_corrections: {name}, seed {seed} ...", flush=True)
            r = table1._run(name, [*DAPO_ROW, *ASYNC, *row], seed, budget, out, prep, nproc=2)
            r.update(_per_step(out / "runs" / f"{table1._slug(name)}_seed{seed}"))
            results.append(r)
    return {"budget": budget, "piece": PIECE, "wall_s": time.perf_counter() - start, "runs": results}


def markdown(result: dict) -> str:
    runs, k = result["runs"], result["runs"][0]["k"]
    lines = [f"| correction | held-out avg@{k} (paper's rule) | final entropy | mismatch KL | token chi² | "
             "weight std | ESS | tokens above upper | below lower | version lag | steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, _ in ROWS:
        rs = [r for r in runs if r["row"] == name]
        col = lambda key: [r[key] for r in rs]  # noqa: E731
        lines.append(f"| {name} | {table1._mean_sd(col('avg_at_k'))} | {table1._mean_sd(col('entropy'))} | "
                     + " | ".join(table1._mean_sd(col(key)) for key in PER_STEP)
                     + f" | {statistics.fmean(col('steps')):.0f} |")
    seeds = sorted({r["seed"] for r in runs})
    run_s = sum(r["wall_s"] for r in runs)
    lines.append(f"\nMean ± sample standard deviation over seeds {seeds}; per-step columns averaged over each run's "
                 f"steps; every run stopped after {result['budget']} generated responses. The runs took "
                 f"{run_s / 60:.1f} min (one at a time, 2 processes each).")
    return "\n".join(lines)


def figures(result: dict) -> list[dict]:
    """Each correction's final held-out avg@k (mean over seeds) against token TIS's, the async default,
    from the same run. No targets: the miniature does not rank them (docs/losses.md)."""
    runs, base = result["runs"], ROWS[0][0]
    mean = {name: statistics.fmean(r["avg_at_k"] for r in runs if r["row"] == name) for name, _ in ROWS}
    k, seeds = runs[0]["k"], len({r["seed"] for r in runs})
    return [dict(figure=f"{name}: final held-out avg@{k}, partial rollouts at staleness 1 ({seeds} seed(s), "
                        f"{result['budget']} responses)",
                 value=mean[name], unit=f"avg@{k}", baseline_name=None if name == base else base,
                 baseline=None if name == base else mean[base],
                 ratio=None if name == base else mean[name] / mean[base], target=None, met=None)
            for name, _ in ROWS]


# Quick: one seed, 640 responses a run; full: the CLI's defaults.
QUICK = dict(seeds=1, budget=640)
FULL = dict(seeds=3, budget=10240)


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry, in a temporary directory: QUICK or FULL (see above)."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_corrections_") as tmp:
        result = measure(size["seeds"], size["budget"], Path(tmp))
    runs = [{k: v for k, v in r.items() if k not in ("curve", "entropy_curve")} for r in result["runs"]]
    return dict(name="rollout_corrections", figures=figures(result), markdown=markdown(result),
                details=dict(result, runs=runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=FULL["seeds"], help="seeds 1..N per row")
    p.add_argument("--budget", type=int, default=FULL["budget"], help="generated responses per run")
    p.add_argument("--out", default="runs/rollout_corrections", help="output dir; finished runs are reused on a rerun")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.seeds, args.budget, out)
    (out / "rollout_corrections.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "rollout_corrections.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
