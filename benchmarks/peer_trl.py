"""Ours against Hugging Face TRL's GRPOTrainer configured as DAPO, at the same work on the CPU demo.

Both sides train the demo's own base model (made once per seed by our toy bootstrap, one thread)
on its prompts with its scorer: group size 8, 16 prompts per step, 16-token responses, 4 updates
per step (TRL: ``steps_per_generation=4``, so it recomputes old log-probs as we do), lr 1e-3 with
3 steps (12 updates) of warm-up, fp32, one thread per process, our dynamic sampling off (TRL has
none), no evaluation inside the loop. Runs alternate ours / TRL. Each side's held-out avg@4 is
measured after training by the same code (toy.base.evaluate: our evaluator on the HF engine),
ours on its exported final checkpoint.

Figures: the sum of step seconds (ours: ``timing_s/step`` less the final step's evaluation and
checkpoint write, which TRL does not do; TRL: each optimizer step's seconds, generation included,
summed per 4 updates), the median step, the command's wall time, trained response tokens per step
second, peak RSS (the process and its live children, sampled: ours the trainer and its reward worker,
TRL its one process), held-out avg@4
per seed; at DP=2 (torchrun, 2 processes) the step seconds. What cannot be matched is listed in
the markdown (UNMATCHED).

    python benchmarks/peer_trl.py            # 80 steps, seeds 1 2 3, then DP=2 on each (~6 min)
    python benchmarks/peer_trl.py --quick    # 20 steps, seed 1
    python benchmarks/peer_trl.py --profile  # by phase and by op, demo size and a larger toy (~3 min)
TRL comes from the ``peer`` extra (``./install.sh peer``); without it the benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TARGETS = {"step_1": 0.83, "step_dp2": 0.7, "rss": 1.0}  # ours / TRL, at most
UNMATCHED = (
    "dynamic sampling (TRL has none: ours is off here)",
    "the token-mean denominator (ours: every valid token of the mini-batch, across ranks; TRL's `dapo`: "
    "the generation batch's tokens rescaled to one update, the same number here up to rounding)",
    "mini-batch order (ours: a step's groups in order; TRL: shuffled by its sampler)",
    "the advantage epsilon (both divide by the sample std; ours adds 1e-6, TRL 1e-4)",
    "the warm-up's first update (ours: lr x 1/12; TRL's constant_with_warmup: lr x 0)",
    "prompt order (each side's own seeded sampler)",
)


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int = 80
    prompts: int = 16
    n: int = 8
    max_tokens: int = 16
    updates: int = 4
    lr: float = 1e-3
    warmup_steps: int = 3
    seeds: tuple[int, ...] = (1, 2, 3)
    dp2: bool = True
    ours_extra: tuple[str, ...] = ()  # more overrides of our side (--ours-set)
    toy: tuple[str, ...] = ()  # toy.* overrides: another base model (both sides train it)

    def ours(self, seed: int) -> list[str]:
        return ["--config", str(ROOT / "conf/cpu_tiny.yaml"), f"seed={seed}", f"train.total_steps={self.steps}",
                f"data.prompts_per_step={self.prompts}", f"data.gen_prompts_per_batch={self.prompts}",
                f"rollout.n={self.n}", f"rollout.max_response_length={self.max_tokens}",
                f"train.mini_batch_prompts={self.prompts // self.updates}", f"optim.lr={self.lr}",
                f"optim.lr_warmup_steps={self.warmup_steps}", "algorithm.filter_groups.enable=false",
                "eval.every=0", "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false",
                *self.toy, *self.ours_extra]

    def trl(self, seed: int, inputs: Path, out: Path) -> list[str]:
        return ["--base", str(inputs / "toy_base"), "--train", str(inputs / "toy_data/train.parquet"),
                "--val", str(inputs / "toy_data/val.parquet"), "--out", str(out), "--seed", str(seed),
                "--steps", str(self.steps), "--prompts-per-step", str(self.prompts), "--group-size", str(self.n),
                "--max-tokens", str(self.max_tokens), "--updates-per-step", str(self.updates), "--lr", str(self.lr),
                "--warmup-updates", str(self.warmup_steps * self.updates), "--clip-grad", "1.0", "--clip-low", "0.2",
                "--clip-high", "0.28", "--clip-c", "10.0", "--buffer-len", "4", "--penalty-factor", "1.0",
                "--eval-n", "4", "--eval-top-p", "0.7", "--eval-max-tokens", str(self.max_tokens), "--threads", "1"]


_OURS = """
import json, os, sys
sys.path.insert(0, "benchmarks")
from _rss import TreePeak
from megatron_dapo import cli
run_dir, out, max_eval, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
tree = TreePeak()
if os.environ.get("PEER_PROFILE"):  # peer_trl --profile: the training command under cProfile
    import cProfile
    prof = cProfile.Profile()
    rc = prof.runcall(cli.main, ["train", *args, "logging.dir=" + run_dir])
    prof.dump_stats(os.environ["PEER_PROFILE"])
else:
    rc = cli.main(["train", *args, "logging.dir=" + run_dir])
assert rc == 0, rc
result = {"peak_rss_mb": tree.peak_mb()}
if out != "-":  # held-out avg@4 of the final checkpoint, by the code TRL's side measures its own with
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from _peer_trl_side import held_out
    assert cli.main(["export", *args, "logging.dir=" + run_dir, "--out", out, "--no-progress"]) == 0
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    seed = int(next(a.split("=")[1] for a in args if a.startswith("seed=")))
    result["eval"] = held_out(model, tok, run_dir + "/toy_data/val.parquet", n=4, top_p=0.7, max_tokens=max_eval,
                              seed=seed)
print("PEER_RESULT " + json.dumps(result), flush=True)
"""


def _env() -> dict:
    keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    return {**keep, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), **(env or {})}, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - start
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {out.returncode}; see {log}:\n{out.stderr[-1500:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PEER_RESULT ")]
    return (json.loads(lines[-1].split(" ", 1)[1]) if lines else {}), wall


def prepare(work: Path, seed: int, toy: tuple[str, ...] = ()) -> Path:
    """The demo's toy data and base for ``seed`` (and ``toy`` overrides), made as the trainer makes them."""
    inputs = work / f"inputs_seed{seed}{'_toy' if toy else ''}"
    code = ("import sys, torch; torch.set_num_threads(1)\n"
            "from pathlib import Path\nfrom megatron_dapo.config_loading import load_config\n"
            "from megatron_dapo.toy.bootstrap import materialise\n"
            f"cfg = load_config('{ROOT / 'conf/cpu_tiny.yaml'}', ['seed={seed}', 'logging.dir=' + sys.argv[1], "
            "*sys.argv[2:]])\nmaterialise(cfg, Path(sys.argv[1]), 0)")
    subprocess.run([PY, "-c", code, str(inputs), *toy], check=True, env=_env(), cwd=ROOT, capture_output=True,
                   timeout=900)
    return inputs


def run_ours(s: Settings, seed: int, inputs: Path, work: Path, tag: str, world: int = 1, env=None) -> dict:
    run_dir = work / f"ours_{tag}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    subprocess.run(["cp", "-r", str(inputs), str(run_dir)], check=True)  # the toy inputs, already made
    if world == 1:
        cmd = [PY, "-c", _OURS, str(run_dir), str(work / f"ours_{tag}_hf"), str(s.max_tokens), *s.ours(seed)]
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
               "megatron_dapo.cli", "train", *s.ours(seed), f"logging.dir={run_dir}"]
    result, wall = _run(cmd, work / f"ours_{tag}.log", env)
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "timing_s/step" in r]
    seconds = [r["timing_s/step"] - r.get("timing_s/eval", 0.0) - r.get("timing_s/checkpoint_write", 0.0)
               for r in steps]
    tokens = sum(r["response_length/mean"] * s.prompts * s.n for r in steps)
    return {**result, "step_seconds": seconds, "wall_s": wall, "tokens": tokens,
            "phases": {k: sum(r.get(f"timing_s/{k}", 0.0) for r in steps)
                       for k in ("rollout", "old_log_probs", "train", "weight_sync")}}


def run_trl(s: Settings, seed: int, inputs: Path, work: Path, tag: str, world: int = 1, env=None) -> dict:
    side = str(ROOT / "benchmarks/_peer_trl_side.py")
    launch = [PY, side] if world == 1 else [PY, "-m", "torch.distributed.run", "--standalone",
                                             f"--nproc-per-node={world}", side]
    result, wall = _run([*launch, *s.trl(seed, inputs, work / f"trl_{tag}")], work / f"trl_{tag}.log", env)
    return {**result, "wall_s": wall}


def compare(s: Settings, work: Path, keep: Path | None = None) -> dict:
    """Every run, interleaved: per seed ours then TRL (the order flips each seed), then DP=2 the same way.
    ``keep``: every finished run is written there as it ends (a later failure loses nothing)."""
    runs: dict = {"ours": {}, "trl": {}}
    for i, seed in enumerate(s.seeds):
        inputs = prepare(work, seed)
        order = (("ours", run_ours), ("trl", run_trl)) if i % 2 == 0 else (("trl", run_trl), ("ours", run_ours))
        for side, fn in order:
            print(f"peer_trl: seed {seed}, {side} ...", flush=True)
            runs[side][seed] = fn(s, seed, inputs, work, f"seed{seed}")
            if keep:
                keep.write_text(json.dumps(runs))
    for i, seed in enumerate(s.seeds if s.dp2 else ()):  # DP=2 per seed too: one pair of runs was noise-bound
        inputs = work / f"inputs_seed{seed}"
        pair = (("trl", run_trl), ("ours", run_ours))
        order = pair if i % 2 == 0 else pair[::-1]
        for side, fn in order:
            print(f"peer_trl: DP=2, seed {seed}, {side} ...", flush=True)
            runs[side][f"dp2_{seed}"] = fn(s, seed, inputs, work, f"dp2_seed{seed}", world=2)
            if keep:
                keep.write_text(json.dumps(runs))
    return runs


def summarise(s: Settings, runs: dict) -> tuple[list[dict], str]:
    seeds = list(s.seeds)

    def per_side(side):
        r = runs[side]
        step = statistics.mean(sum(r[k]["step_seconds"]) for k in seeds)
        return {"step": step, "median": statistics.median(x for k in seeds for x in r[k]["step_seconds"]),
                "wall": statistics.mean(r[k]["wall_s"] for k in seeds),
                "rss": max(r[k]["peak_rss_mb"] for k in seeds),
                "acc": [r[k]["eval"]["acc_mean"] for k in seeds],
                "dp2": statistics.median(x for k in seeds for x in _dp2_steps(r[f"dp2_{k}"]))
                if f"dp2_{seeds[0]}" in r else None,
                "dp2_sum": statistics.mean(sum(_dp2_steps(r[f"dp2_{k}"])) for k in seeds)
                if f"dp2_{seeds[0]}" in r else None}

    ours, trl = per_side("ours"), per_side("trl")
    tokens = statistics.mean(runs["ours"][k]["tokens"] for k in seeds)
    rows = [("sum of step seconds", "step", "s"), ("median seconds per step", "median", "s"),
            ("wall time of the command", "wall", "s"), ("peak RSS", "rss", "MiB")]
    figures = []

    def fig(name, value, unit, base, target=None):
        ratio = value / base if base else None
        figures.append({"figure": name, "value": value, "unit": unit, "baseline_name": "TRL GRPOTrainer (DAPO)",
                        "baseline": base, "ratio": ratio, "target": f"<= {target}x" if target else None,
                        "met": None if target is None else ratio <= target})

    fig(f"sum of step seconds, 1 process ({s.steps} steps, mean of {len(seeds)} seeds)", ours["step"], "s",
        trl["step"], TARGETS["step_1"])
    fig("median seconds per step, 1 process", ours["median"], "s", trl["median"])
    fig("wall time of the command, 1 process", ours["wall"], "s", trl["wall"])
    fig("peak RSS, 1 process", ours["rss"], "MiB", trl["rss"], TARGETS["rss"])
    fig("trained response tokens per step second, 1 process", tokens / ours["step"], "tokens/s",
        tokens / trl["step"])
    if ours["dp2"] is not None:
        fig(f"sum of step seconds, DP=2 (2 processes, mean of {len(seeds)} seeds)", ours["dp2_sum"], "s",
            trl["dp2_sum"], TARGETS["step_dp2"])
    for seed, a, b in zip(seeds, ours["acc"], trl["acc"]):
        figures.append({"figure": f"held-out avg@4, seed {seed}", "value": a, "unit": "fraction",
                        "baseline_name": "TRL GRPOTrainer (DAPO)", "baseline": b, "ratio": a / b if b else None,
                        "target": None, "met": None})
    md = ["| | megatron-dapo | TRL | ratio |", "|---|---|---|---|"]
    for label, key, unit in rows:
        md.append(f"| {label} ({unit}) | {ours[key]:.3g} | {trl[key]:.3g} | {ours[key] / trl[key]:.2f} |")
    md.append(f"| held-out avg@4, seeds {'/'.join(map(str, seeds))} | {' / '.join(f'{a:.3f}' for a in ours['acc'])}"
              f" | {' / '.join(f'{a:.3f}' for a in trl['acc'])} | |")
    if ours["dp2"] is not None:
        md.append(f"| DP=2, sum of step seconds (mean of {len(seeds)} seeds) | {ours['dp2_sum']:.3g} | "
                  f"{trl['dp2_sum']:.3g} | {ours['dp2_sum'] / trl['dp2_sum']:.2f} |")
    phases = {k: statistics.mean(runs["ours"][sd]["phases"][k] for sd in seeds)
              for k in runs["ours"][seeds[0]]["phases"]}
    gen = statistics.mean(sum(runs["trl"][sd].get("generate_seconds", [])) for sd in seeds)
    md += ["", "Ours by phase (s, mean over seeds): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
           + f"; TRL's generation + scoring + old log-probs: {gen:.2f} s.", "",
           "Not matched: " + "; ".join(UNMATCHED) + "."]
    return figures, "\n".join(md)


def _dp2_steps(result: dict) -> list[float]:
    """A DP=2 run's step seconds: ours a list per step; TRL's side reports their sum only."""
    steps = result["step_seconds"]
    return steps if isinstance(steps, list) else [steps]


def available() -> str | None:
    return None if importlib.util.find_spec("trl") else "TRL is not installed: ./install.sh peer"


def run(quick: bool, keep: Path | None = None, ours_extra: tuple[str, ...] = ()) -> dict:
    s = Settings(steps=20, seeds=(1,), dp2=False, ours_extra=ours_extra) if quick else Settings(ours_extra=ours_extra)
    missing = available()
    if missing:
        return {"name": "peer_trl", "markdown": missing, "figures": []}
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        runs = compare(s, Path(tmp), keep)
    figures, md = summarise(s, runs)
    return {"name": "peer_trl", "markdown": md, "figures": figures, "details": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="also write the figures and every run here")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of our side (repeatable), e.g. train.old_log_probs=trainer")
    p.add_argument("--profile", action="store_true",
                   help="instead: each side under cProfile at the demo size and a larger toy (_peer_trl_profile.py)")
    args = p.parse_args(argv)
    if args.profile:
        from _peer_trl_profile import profile

        if available():
            print(available())
            return 1
        with tempfile.TemporaryDirectory(prefix="peer_trl_profile_") as tmp:
            print(profile(Settings(ours_extra=tuple(args.ours_set)), Path(tmp), run_ours, run_trl, prepare))
        return 0
    result = run(args.quick, Path(args.json + ".runs") if args.json else None, tuple(args.ours_set))
    print(result["markdown"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["figures"] else 1


if __name__ == "__main__":
    sys.exit(main())
