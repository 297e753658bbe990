"""Fault injection at full size on the CPU job (issue 14; tests/functional/test_faults.py runs a few).

One uninterrupted reference run, then one run directory that is hit ``--kills`` times by SIGKILL to
the trainer alone (at a random moment, and every third time as soon as a checkpoint save starts)
and ``--signals`` times by SIGTERM / SIGUSR1 / SIGINT (in turn, at a random moment), relaunching
after each, until it completes. Counts what the issue asks about: processes the trainer started
that outlive it, kills that landed inside a save, signal exits that were not "exit 0 with a
checkpoint", and metrics records that are missing, duplicated or differ from the reference.

    python benchmarks/fault_campaign.py --kills 30 --signals 9 [--steps 24]
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}


def _cmd(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
            f"logging.dir={run_dir}", f"train.total_steps={steps}", "checkpoint.save_every=3", "eval.every=6",
            "logging.tensorboard=false"]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _values(records):
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith("timing_s/")} for r in records}


def _saving(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.suffix == ".tmp" for p in ckpts.iterdir())


def _hit(run_dir: Path, steps: int, sig: int, rng: random.Random, mid_save: bool, log) -> dict:
    proc = subprocess.Popen(_cmd(run_dir, steps), cwd=ROOT, stdout=log, stderr=log, env=ENV)
    deadline = time.time() + (rng.uniform(2.0, 20.0) if not mid_save else 300)
    while time.time() < deadline and proc.poll() is None and not (mid_save and _saving(run_dir)):
        time.sleep(0.001 if mid_save else 0.05)
    if proc.poll() is not None:
        return {"finished": True}
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, sig)
    rc = proc.wait(timeout=600)
    _, alive = psutil.wait_procs(children, timeout=20)
    for p in alive:
        p.kill()
    return {"finished": False, "rc": rc, "children": len(children), "left": len(alive),
            "in_save": _saving(run_dir) if sig == signal.SIGKILL else False}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--signals", type=int, default=9)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    start = time.time()
    with tempfile.TemporaryDirectory() as d, open(Path(d) / "log.txt", "w") as log:
        ref, run = Path(d) / "reference", Path(d) / "run"
        subprocess.run(_cmd(ref, args.steps), cwd=ROOT, stdout=log, stderr=log, env=ENV, check=True)
        for name in ("toy", "toy_data", "toy_base"):
            shutil.copytree(ref / name, run / name)
        plan = [signal.SIGKILL] * args.kills + [(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)[i % 3]
                                                for i in range(args.signals)]
        rng.shuffle(plan)
        outcomes = []
        for i, sig in enumerate(plan):
            mid_save = sig == signal.SIGKILL and sum(s == signal.SIGKILL for s in plan[:i]) % 3 == 0
            out = _hit(run, args.steps, sig, rng, mid_save, log)
            outcomes.append((signal.Signals(sig).name, out))
            if out["finished"]:
                shutil.rmtree(run / "checkpoints")  # start over (same toy): more faults to inject
                (run / "metrics.jsonl").unlink()
        final = subprocess.run(_cmd(run, args.steps), cwd=ROOT, stdout=log, stderr=log, env=ENV)
        got, want = _records(run), _records(ref)
    steps = [r["step"] for r in got]
    hits = [(s, o) for s, o in outcomes if not o["finished"]]
    kills = [o for s, o in hits if s == "SIGKILL"]
    sigs = [(s, o) for s, o in hits if s != "SIGKILL"]
    equal = sum(v == want_v for st, v in _values(got).items() for want_v in [_values(want).get(st)])
    num_values = sum(len(v) for v in _values(want).values())
    print(f"{len(plan)} faults planned, {len(hits)} landed ({len(plan) - len(hits)} runs finished first and "
          "were started over)")
    print(f"{len(kills)} SIGKILLs to the trainer alone ({sum(o['in_save'] for o in kills)} inside a checkpoint "
          f"save), {sum(o['children'] for o in kills)} child processes then alive, "
          f"{sum(o['left'] for o in kills)} left 20 s after the kill")
    bad = [(s, o["rc"]) for s, o in sigs if o["rc"] != 0]
    print(f"{len(sigs)} stop signals ({', '.join(sorted({s for s, _ in sigs}))}): {len(sigs) - len(bad)} exited 0 "
          f"with a checkpoint, others: {bad}")
    print(f"final resume rc {final.returncode}; records {len(got)} for steps 0..{args.steps} "
          f"(each once: {steps == list(range(args.steps + 1))}); records equal to the reference: {equal}/"
          f"{len(want)} ({num_values} values); wall {time.time() - start:.0f} s")
    ok = final.returncode == 0 and steps == list(range(args.steps + 1)) and equal == len(want) and not bad
    return 0 if ok and not any(o["left"] for o in kills) else 1


if __name__ == "__main__":
    sys.exit(main())
