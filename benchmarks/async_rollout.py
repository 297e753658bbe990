"""What separate placement and bounded staleness buy: measured on the CPU, modelled at 32B.

Measured (one run per mode, modes interleaved, REPS times): the CPU demo's loop in 2 processes on a
toy with a long tail of response lengths (problems of 4 to 12 digits, the base answering with the
optional reasoning line half the time: 5 tokens without it, up to 20 with it), dynamic sampling on:

    colocated       torchrun 2 ranks: DP=2, each rank a replica (generate, then train, in turn)
    separate k=0    rank 0 trains, rank 1 holds the engine; generate, then train (rollout.max_staleness=0)
    separate k=1    the next step's first batch generates while this step trains
    separate k=2    up to two steps ahead
    partial k=1     as k=1, and a generation batch extends a response by at most 8 tokens (rollout.partial):
                    one still running continues in the next batch

Figures per mode: the sum of step seconds (steps 2..N-1: step 1 holds the engine's start-up, the
last step the final evaluation), trained responses per second, the trainer's wait for generation and the
engines' idle time (as fractions of it), the mean weight-version lag, held-out avg@4 at the end.

Modelled (megatron_dapo/step_model.py): the separate placement's timeline, at the k=0 run's mean
phase seconds (per generation batch, per step's training) and each run's own count of generation
batches per step, predicts the k=1 and k=2 step seconds against k=0's; the ratio to the measured one
must be within 15% before the model projects the 32B recipe (benchmarks/_async_projection.py). For
partial rollouts the k=0 run's generation seconds per batch are scaled by decode steps (the batch's
longest response, or the piece cap, plus one for the prefill; the HF engine steps every row of a
batch together):
generation per replica by continuous batching over long-tail length distributions, at the plan's
decode costs; training from the plan's estimate; the GPUs split between the sides at the best split
for each staleness.

    python benchmarks/async_rollout.py            # 40 steps a run, 2 rounds (~8 min on 2 cores)
    python benchmarks/async_rollout.py --quick    # 12 steps, 1 round (~2 min)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dapo.step_model import StepWork, separate  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _async_projection import markdown as projection_markdown  # noqa: E402
from _async_projection import project  # noqa: E402

CONFIG = ROOT / "conf" / "cpu_tiny.yaml"
TOY = ["toy.min_digits=4", "toy.num_digits=12", "rollout.max_response_length=24"]
PIECE = 8  # partial rollouts: tokens a response grows by in a batch (a third of the limit)
COMMON = [*TOY, "eval.every=0", "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false",
          "logging.progress=false", "train.old_log_probs=trainer"]
MODES = {
    "colocated": [],
    "separate k=0": ["rollout.placement=separate", "rollout.num_ranks=1"],
    "separate k=1": ["rollout.placement=separate", "rollout.num_ranks=1", "rollout.max_staleness=1"],
    "separate k=2": ["rollout.placement=separate", "rollout.num_ranks=1", "rollout.max_staleness=2"],
    "partial k=1": ["rollout.placement=separate", "rollout.num_ranks=1", "rollout.max_staleness=1",
                    "rollout.partial=true", f"rollout.partial_tokens={PIECE}"],
}
MODEL_TOLERANCE = 0.15  # the model's ratio against the measured one, either way
RESPONSES_PER_STEP = 16 * 8  # conf/cpu_tiny.yaml: data.prompts_per_step x rollout.n


def _make_toy(work: Path) -> Path:
    prep = work / "toy_prep"
    code = ("import sys; from pathlib import Path; from megatron_dapo.config_loading import load_config; "
            "from megatron_dapo.toy.bootstrap import materialise; "
            "cfg = load_config(sys.argv[1], sys.argv[2:]); materialise(cfg, Path(cfg.logging.dir), 0)")
    subprocess.run([sys.executable, "-c", code, str(CONFIG), *TOY, f"logging.dir={prep}"], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    return prep


def run_mode(mode: str, steps: int, prep: Path, run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    for part in ("toy", "toy_data", "toy_base"):
        shutil.copytree(prep / part, run_dir / part)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(CONFIG), *COMMON, *MODES[mode],
           f"train.total_steps={steps}", f"logging.dir={run_dir}"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")})
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in records if r["step"]], "wall_s": time.perf_counter() - started}


def _step_s(r: dict) -> float:
    return r["timing_s/step"] - r.get("timing_s/eval", 0.0) - r.get("timing_s/checkpoint_write", 0.0)


def summarise(records: list[dict]) -> dict:
    """Steps 2..N-1 of one run (step 1 holds the engine's start-up, step N the final evaluation)."""
    rest = records[1:-1]
    total = sum(_step_s(r) for r in rest)
    return {"step_s": total, "responses_per_s": len(rest) * RESPONSES_PER_STEP / total,
            "trainer_waited": sum(r.get("timing_s/trainer_waited", 0.0) for r in rest) / total,
            "engines_idle": sum(r.get("timing_s/engines_idle", 0.0) for r in rest) / total,
            "lag_mean": statistics.mean(r["rollout/version_lag_mean"] for r in rest),
            "gen_batches": statistics.mean(r["dynamic_sampling/num_gen_batches"] for r in rest),
            "response_length": statistics.mean(r["response_length/mean"] for r in rest),
            "final_avg4": records[-1].get("eval/avg@4")}


def costs(records: list[dict]) -> dict[str, float]:
    """A k=0 separate run's mean phase seconds: the trainer's wait is the engines' generation (the
    previous weights' load included, queued before the first batch), per batch; the rest of the
    rollout phase is scoring, per batch; the rest of the step is the trainer's (old log-probs,
    updates, export and send). Steps 2..N-1."""
    rest = records[1:-1]
    batches = sum(r["dynamic_sampling/num_gen_batches"] for r in rest)
    return {"generation": sum(r["timing_s/trainer_waited"] for r in rest) / batches,
            "score": sum(r["timing_s/rollout"] - r["timing_s/trainer_waited"] for r in rest) / batches,
            "train": statistics.mean(_step_s(r) - r["timing_s/rollout"] for r in rest)}


def predict(records: list[dict], k: int, phase: dict[str, float], generation_scale: float = 1.0) -> float:
    """The model's sum of step seconds over steps 2..N-1 of the run ``records`` at staleness ``k``: its
    own generation batches per step (dynamic sampling's count), at the k=0 run's phase costs, its
    generation per batch times ``generation_scale``."""
    work = [StepWork((phase["generation"] * generation_scale,) * int(r["dynamic_sampling/num_gen_batches"]),
                     phase["score"], phase["train"]) for r in records]
    return sum(separate(work, max_staleness=k).step_s[1:-1])


def measure(steps: int, reps: int, work: Path) -> dict:
    prep = _make_toy(work)
    runs: dict[str, list] = {m: [] for m in MODES}
    for rep in range(reps):
        order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            print(f"async_rollout: round {rep + 1}, {mode} ...", flush=True)
            runs[mode].append(run_mode(mode, steps, prep, work / "run"))
    return runs


def results(runs: dict) -> dict:
    summary = {m: {k: statistics.mean(summarise(r["records"])[k] for r in rs)
                   for k in summarise(rs[0]["records"])} for m, rs in runs.items()}
    model = {}
    for k in (1, 2):  # each round's k run against the same round's k=0 run
        pairs = list(zip(runs["separate k=0"], runs[f"separate k={k}"]))
        predicted = statistics.mean(predict(r["records"], k, costs(r0["records"]))
                                    / predict(r0["records"], 0, costs(r0["records"])) for r0, r in pairs)
        measured = summary[f"separate k={k}"]["step_s"] / summary["separate k=0"]["step_s"]
        model[k] = {"predicted": predicted, "measured": measured, "error": predicted / measured - 1}
    pairs = list(zip(runs["separate k=0"], runs["partial k=1"]))
    predicted = statistics.mean(predict(r["records"], 1, costs(r0["records"]), decode_scale(r0["records"]))
                                / predict(r0["records"], 0, costs(r0["records"])) for r0, r in pairs)
    measured = summary["partial k=1"]["step_s"] / summary["separate k=0"]["step_s"]
    model["partial k=1"] = {"predicted": predicted, "measured": measured, "error": predicted / measured - 1}
    return {"summary": summary, "model": model}


def decode_scale(records: list[dict]) -> float:
    """A partial batch's generation seconds against a whole one's: decode steps plus the prefill, the
    whole batch's steps taken as its longest response (``response_length/max``, steps 2..N-1), a
    partial batch's as the piece cap."""
    longest = statistics.mean(r["response_length/max"] for r in records[1:-1])
    return (min(PIECE, longest) + 1) / (longest + 1)


def figures(res: dict, proj: dict) -> list[dict]:
    s, out = res["summary"], []
    for mode in MODES:
        if mode == "colocated":
            continue
        out.append(dict(figure=f"step seconds, {mode} / colocated", value=s[mode]["step_s"], unit="s",
                        baseline_name="colocated", baseline=s["colocated"]["step_s"],
                        ratio=s[mode]["step_s"] / s["colocated"]["step_s"], target=None, met=None))
    for k, m in res["model"].items():
        out.append(dict(figure=f"model / measured, {k if isinstance(k, str) else f'k={k}'} vs k=0 step seconds",
                        value=m["predicted"], unit="ratio",
                        baseline_name="measured", baseline=m["measured"], ratio=m["predicted"] / m["measured"],
                        target=f"within {MODEL_TOLERANCE:.0%}", met=abs(m["error"]) <= MODEL_TOLERANCE))
    base = proj["base"]["placements"]
    for mode in ("separate k=1", "partial k=1"):
        out.append(dict(figure=f"32B projected step minutes, {mode} (modelled, base scenario)",
                        value=base[mode]["step_min"], unit="min", baseline_name="colocated (modelled)",
                        baseline=base["colocated"]["step_min"],
                        ratio=base[mode]["step_min"] / base["colocated"]["step_min"], target=None, met=None))
    return out


def markdown(res: dict, proj: dict) -> str:
    s = res["summary"]
    lines = ["Measured on this machine (2 processes, 1 thread each; steps 2..N-1):", "",
             "| mode | step seconds | vs colocated | responses/s | trainer waited | engines idle | lag | "
             "gen batches | avg@4 at end |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, v in s.items():
        final = "-" if v["final_avg4"] is None else f"{v['final_avg4']:.3f}"
        # colocated, the two sides are the same ranks taking turns: neither waits for the other
        waits = "- | -" if mode == "colocated" else f"{v['trainer_waited']:.0%} | {v['engines_idle']:.0%}"
        lines.append(f"| {mode} | {v['step_s']:.2f} | {v['step_s'] / s['colocated']['step_s']:.2f} | "
                     f"{v['responses_per_s']:.0f} | {waits} | "
                     f"{v['lag_mean']:.2f} | {v['gen_batches']:.2f} | {final} |")
    lines += ["", "The model (megatron_dapo/step_model.py) at the k=0 run's phase seconds, each run's batches:", "",
              "| mode | predicted vs k=0 | measured vs k=0 | error |", "|---|---|---|---|"]
    for k, m in res["model"].items():
        name = k if isinstance(k, str) else f"separate k={k}"
        lines.append(f"| {name} | {m['predicted']:.3f} | {m['measured']:.3f} | {m['error']:+.1%} |")
    a = proj["assumptions"]
    lines += ["", f"Modelled, the 32B recipe on {a['world']} H100s (its plan's decode and training costs; minutes "
              "per step, speedup against colocated, the best split of engine / trainer GPUs):", "",
              projection_markdown(proj)]
    return "\n".join(lines)


QUICK, FULL = dict(steps=12, reps=1), dict(steps=40, reps=2)


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry, in a temporary directory."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        runs = measure(size["steps"], size["reps"], Path(tmp))
    res, proj = results(runs), project()
    return dict(name="async_rollout", figures=figures(res, proj), markdown=markdown(res, proj),
                details=dict(res, projection=proj, size=size))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write every run's records and the results here")
    args = p.parse_args()
    size = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        runs = measure(size["steps"], size["reps"], Path(tmp))
    res, proj = results(runs), project()
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "results": res, "projection": proj}, indent=1))
    print(markdown(res, proj))


if __name__ == "__main__":
    main()
