"""DAPO's Table 1 in miniature, on a CPU: the paper's progression of techniques at one generation budget.

Rows, cumulative as in the paper's Table 1 (each adds one technique to the row above):
  GRPO                 symmetric clip 0.2, sample-level loss (seq-mean-token-mean), no dynamic
                       sampling, no overlong shaping
  + overlong filtering truncated responses are masked out of the loss
  + clip-higher        eps_high 0.28 (eps_low stays 0.2)
  + soft punishment    Eq. 13: a penalty growing linearly over the last 4 tokens before the limit
  + token-level loss   token-mean over the mini-batch instead of the mean of per-sample means
  + dynamic sampling   groups whose answers are all right or all wrong are dropped and replaced
                       (generation batches of 24 prompts until 16 mixed groups are held) = DAPO

The task is the CPU demo's ("largest digit of N?", conf/cpu_tiny.yaml) made to give each technique
something to act on:
  * lengths vary, against a real limit: problems have 4 to 12 digits, the base answers with the
    optional reasoning line half the time ("Check <digits>." then "Answer: d": 12 to 20 tokens, or
    5 without it), and responses are cut at 14 tokens, so reasoning on 7 or more digits is
    truncated before its answer (scored wrong); truncation, filtering and the soft penalty matter;
  * the base answers a random digit (accuracy ~1/7), so the policy starts with high entropy and can
    collapse onto a few answers;
  * groups of 8 saturate (all right) as the policy learns, so dynamic sampling has groups to drop.
No row is tuned: every row runs the same seeds, the same starting model and data per seed, the same
learning rate, and stops after the same number of generated responses (``train.generation_budget``),
counted over every generation batch, kept or dropped. With dynamic sampling a step costs more
generation, so that row takes fewer steps within the budget.

    python benchmarks/table1.py                  # 6 rows x 3 seeds, ~15 min on 2 cores
    python benchmarks/table1.py --seeds 1 --budget 2048   # a quick look, ~2 min

``run(quick)`` (benchmarks/run_all.py) gives each row's final accuracy against GRPO's as figures,
for 1 seed at 640 responses (quick) or the defaults, in a temporary directory.

Writes <out>/table1.json (every run's final numbers and curve), <out>/table1.md (the table docs/table1.md
shows) and <out>/table1.png (held-out accuracy, entropy and response length against generated
responses, mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "cpu_tiny.yaml"

TASK = [  # the miniature's task and protocol, the same for every row
    "toy.min_digits=4", "toy.num_digits=12",
    "rollout.max_response_length=14", "eval.max_response_length=14", "reward.overlong_buffer.len=4",
    "loss.clip_ratio_c=null",  # the paper has no dual clip (verl's recipe adds one)
    "train.total_steps=1000",  # the budget ends every run first
    "eval.n=8", "eval.every=10", "checkpoint.save_every=0", "logging.tensorboard=false", "logging.progress=false",
]
GRPO = ["loss.clip_ratio_high=0.2", "loss.loss_agg_mode=seq-mean-token-mean", "algorithm.filter_groups.enable=false",
        "reward.overlong_buffer.enable=false", "reward.overlong_filter=false"]
STEPS = [  # (row name, the overrides it adds to the rows above)
    ("GRPO", GRPO),
    ("+ overlong filtering", ["reward.overlong_filter=true"]),
    ("+ clip-higher", ["loss.clip_ratio_high=0.28"]),
    ("+ soft overlong punishment", ["reward.overlong_buffer.enable=true"]),
    ("+ token-level loss", ["loss.loss_agg_mode=token-mean"]),
    ("+ dynamic sampling (DAPO)", ["algorithm.filter_groups.enable=true"]),
]


def rows() -> list[tuple[str, list[str]]]:
    """[(name, overrides)], each row's overrides being its own and every row's above it (later win)."""
    out, acc = [], []
    for name, extra in STEPS:
        acc = acc + extra
        out.append((name, list(acc)))
    return out


def _overrides(row: list[str], seed: int, budget: int, run_dir: Path) -> list[str]:
    return [*TASK, *row, f"seed={seed}", f"train.generation_budget={budget}", f"logging.dir={run_dir}"]


def _make_toy(seed: int, out: Path, toy: tuple[str, ...] = (), name: str = "toy") -> Path:
    """The seed's toy data and base, made once (a prep run dir ``<name>_seed<seed>``) and copied into each
    row's run dir; ``toy``: toy.* overrides of the base (the rows must repeat them)."""
    prep = out / f"{name}_seed{seed}"
    if not (prep / "toy" / ".complete").exists():
        code = ("import sys; from pathlib import Path; from megatron_dapo.config_loading import load_config; "
                "from megatron_dapo.toy.bootstrap import materialise; "
                "cfg = load_config(sys.argv[1], sys.argv[2:]); materialise(cfg, Path(cfg.logging.dir), 0)")
        cmd = [sys.executable, "-c", code, str(CONFIG), *_overrides([*GRPO, *toy], seed, 1, prep)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return prep


def _run(name: str, row: list[str], seed: int, budget: int, out: Path, prep: Path, nproc: int = 1) -> dict:
    """One row at one seed (reused when out holds it finished); ``nproc`` > 1 launches it under torchrun
    (a separate placement's engine ranks)."""
    run_dir = out / "runs" / f"{_slug(name)}_seed{seed}"
    if not (run_dir / "done.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        for part in ("toy", "toy_data", "toy_base"):  # same start for every row of this seed
            shutil.copytree(prep / part, run_dir / part)
        launch = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [*launch, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIG),
               *_overrides(row, seed, budget, run_dir)]
        start = time.perf_counter()
        env = {k: v for k, v in os.environ.items()  # a launcher's variables would make it a rank of another job
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-4000:]}")
        (run_dir / "done.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))
    return _summarise(name, seed, run_dir)


def _summarise(name: str, seed: int, run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "rollout/responses_generated_total" in r]
    run_cfg = _yaml(run_dir / "config.yaml")
    avg = f"eval/avg@{run_cfg['eval']['n']}"
    evals = [r for r in records if avg in r]
    last, final = steps[-1], evals[-1]
    trained = last["step"] * run_cfg["data"]["prompts_per_step"] * run_cfg["rollout"]["n"]
    generated = last["rollout/responses_generated_total"]
    by_step = {r["step"]: r["rollout/responses_generated_total"] for r in steps} | {0: 0}
    return {
        "row": name, "seed": seed, "steps": last["step"], "generated": generated,
        "wall_s": json.loads((run_dir / "done.json").read_text())["wall_s"],
        "avg_at_k": final[avg], "k": run_cfg["eval"]["n"],
        "avg_at_k_value": final.get(avg + "_value"),
        "entropy": last["actor/entropy"], "response_length": final["eval/response_length_mean"],
        "truncation_rate": final["eval/truncation_rate"],
        "train_truncation_rate": statistics.fmean(r["response_length/clip_ratio"] for r in steps),
        "generated_per_trained": generated / trained,
        "avg_at_k_by_step": {r["step"]: r[avg] for r in evals},
        "curve": [{"generated": by_step[r["step"]], "avg_at_k": r[avg],
                   "response_length": r["eval/response_length_mean"], "truncation_rate": r["eval/truncation_rate"]}
                  for r in evals],
        "entropy_curve": [{"generated": r["rollout/responses_generated_total"], "entropy": r["actor/entropy"]}
                          for r in steps],
    }


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def table(results: list[dict], budget: int) -> str:
    k = results[0]["k"]
    # the last step every run evaluated at: the rows side by side at equal steps, not equal generation
    common = max(set.intersection(*(set(r["avg_at_k_by_step"]) for r in results)))
    lines = [f"| row | held-out avg@{k} (paper's rule) | avg@{k}, our value scorer | avg@{k} at step {common} | "
             "final entropy | response length (tokens) | truncated (eval) | truncated (training) | generated per "
             "trained sample | steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, _ in STEPS:
        rs = [r for r in results if r["row"] == name]
        col = lambda key: [r[key] for r in rs]  # noqa: E731
        at_common = [r["avg_at_k_by_step"][common] for r in rs]
        lines.append(f"| {name} | {_mean_sd(col('avg_at_k'))} | {_mean_sd(col('avg_at_k_value'))} | "
                     f"{_mean_sd(at_common)} | "
                     f"{_mean_sd(col('entropy'))} | {statistics.fmean(col('response_length')):.1f} | "
                     f"{statistics.fmean(col('truncation_rate')):.3f} | "
                     f"{statistics.fmean(col('train_truncation_rate')):.3f} | "
                     f"{statistics.fmean(col('generated_per_trained')):.2f} | {statistics.fmean(col('steps')):.0f} |")
    seeds = sorted({r["seed"] for r in results})
    lines.append(f"\nMean ± sample standard deviation over seeds {seeds}; every run stopped after {budget} "
                 "generated responses (the step that crossed it included).")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, _ in STEPS:
        rs = [r for r in results if r["row"] == name]
        for ax, curve, key in ((axes[0], "curve", "avg_at_k"), (axes[1], "entropy_curve", "entropy"),
                               (axes[2], "curve", "response_length")):
            grid = np.linspace(0, min(r[curve][-1]["generated"] for r in rs), 40)
            ys = [np.interp(grid, [p["generated"] for p in r[curve]], [p[key] for p in r[curve]]) for r in rs]
            ax.plot(grid, np.mean(ys, axis=0), label=name)
    for ax, title in zip(axes, (f"held-out avg@{results[0]['k']}", "entropy (training tokens)",
                                "response length (eval, tokens)")):
        ax.set_title(title)
        ax.set_xlabel("responses generated")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("DAPO's Table 1 in miniature (CPU toy task, mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# Quick: one seed and 5 GRPO steps' worth of responses. The seed's toy base (~50 s, made before any
# row can start) and each run's start-up and final evaluation dominate, not the steps.
QUICK = dict(seeds=1, budget=640, jobs=2)
# Full: the CLI's defaults; their run (docs/table1.md) fits well inside run_all's hour on 2 cores.
FULL = dict(seeds=3, budget=10240, jobs=2)


def measure(seeds: int, budget: int, jobs: int, out: Path) -> dict:
    """Every row for seeds 1..N, `jobs` runs at once; finished runs under out are reused."""
    start = time.perf_counter()
    seed_list = list(range(1, seeds + 1))
    with ThreadPoolExecutor(jobs) as pool:  # each job is a process; threads only wait
        preps = dict(zip(seed_list, pool.map(lambda s: _make_toy(s, out), seed_list)))
        work = [(name, row, seed) for seed in seed_list for name, row in rows()]
        results = list(pool.map(lambda j: _run(*j, budget, out, preps[j[2]]), work))
    return {"budget": budget, "jobs": jobs, "wall_s": time.perf_counter() - start, "runs": results}


def markdown(result: dict) -> str:
    return (table(result["runs"], result["budget"]) + f" Wall time {result['wall_s'] / 60:.1f} min on this "
            f"machine ({result['jobs']} runs at once).")


def figures(result: dict) -> list[dict]:
    """Each row's final held-out avg@k by the paper's rule (mean over seeds), against the GRPO row's
    from the same run (ratio > 1: the row beats GRPO). No targets: at this scale neighbouring rows
    differ within the seeds' spread (docs/table1.md)."""
    runs = result["runs"]
    mean = {name: statistics.fmean(r["avg_at_k"] for r in runs if r["row"] == name) for name, _ in STEPS}
    grpo, k, seeds = STEPS[0][0], runs[0]["k"], len({r["seed"] for r in runs})
    out = []
    for name, _ in STEPS:
        base = None if name == grpo else mean[grpo]
        out.append(dict(figure=f"{name}: final held-out avg@{k} ({seeds} seed(s), {result['budget']} responses)",
                        value=mean[name], unit=f"avg@{k}", baseline_name=None if base is None else grpo,
                        baseline=base, ratio=mean[name] / base if base else None, target=None, met=None))
    return out


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry, in a temporary directory (runs/ is left alone, nothing reused):
    QUICK (1 seed, 640 responses per run: ~1.5-2 min) or FULL (the CLI's defaults: 3 seeds, 10,240)."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_table1_") as tmp:
        result = measure(size["seeds"], size["budget"], size["jobs"], Path(tmp))
    runs = [{k: v for k, v in r.items() if k not in ("curve", "entropy_curve")} for r in result["runs"]]
    return dict(name="table1", figures=figures(result), markdown=markdown(result), details=dict(result, runs=runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=FULL["seeds"], help="seeds 1..N per row")
    p.add_argument("--budget", type=int, default=FULL["budget"], help="generated responses per run (80 GRPO steps)")
    p.add_argument("--jobs", type=int, default=FULL["jobs"], help="runs at once (one thread each)")
    p.add_argument("--out", default="runs/table1", help="output dir; finished runs are reused on a rerun")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.seeds, args.budget, args.jobs, out)
    md = markdown(result)
    (out / "table1.json").write_text(json.dumps({k: result[k] for k in ("budget", "wall_s", "runs")}, indent=1))
    (out / "table1.md").write_text(md + "\n")
    plot(result["runs"], out / "table1.png")
    print(md)
    print(f"\nwrote {out / 'table1.json'}, {out / 'table1.md'}, {out / 'table1.png'}")


if __name__ == "__main__":
    main()
