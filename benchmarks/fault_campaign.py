"""Fault injection at full size on the CPU job (tests/functional/test_faults.py runs a few).

One uninterrupted reference run, then one run directory that is hit ``--kills`` times by SIGKILL to
the trainer alone (at a random moment, and every third time as soon as a checkpoint save starts)
and ``--signals`` times by SIGTERM / SIGUSR1 / SIGINT (in turn, at a random moment), relaunching
after each, until it completes. Counts what the issue asks about: processes the trainer started
that outlive it, kills that landed inside a save, signal exits that were not "exit 0 with a
checkpoint", and metrics records that are missing, duplicated or differ from the reference.
``run(quick)`` (benchmarks/run_all.py) gives these counts as figures, at a few faults (quick) or
at the defaults below.

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
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}


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


# Steps as in FULL: a shorter run often ends before its random moment (2-20 s), and the fault never lands.
QUICK = dict(kills=2, signals=3, steps=24, seed=0)  # one of each stop signal
FULL = dict(kills=30, signals=9, steps=24, seed=0)


def campaign(kills: int, signals: int, steps: int, seed: int) -> dict:
    """The reference run, the faults with relaunches, and the final resume: what summarise() counts."""
    rng = random.Random(seed)
    start = time.time()
    with tempfile.TemporaryDirectory() as d, open(Path(d) / "log.txt", "w") as log:
        ref, run_dir = Path(d) / "reference", Path(d) / "run"
        subprocess.run(_cmd(ref, steps), cwd=ROOT, stdout=log, stderr=log, env=ENV, check=True)
        for name in ("toy", "toy_data", "toy_base"):
            shutil.copytree(ref / name, run_dir / name)
        plan = [signal.SIGKILL] * kills + [(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)[i % 3]
                                           for i in range(signals)]
        rng.shuffle(plan)
        outcomes = []
        for i, sig in enumerate(plan):
            mid_save = sig == signal.SIGKILL and sum(s == signal.SIGKILL for s in plan[:i]) % 3 == 0
            out = _hit(run_dir, steps, sig, rng, mid_save, log)
            outcomes.append((signal.Signals(sig).name, out))
            if out["finished"]:
                shutil.rmtree(run_dir / "checkpoints")  # start over (same toy): more faults to inject
                (run_dir / "metrics.jsonl").unlink()
        final = subprocess.run(_cmd(run_dir, steps), cwd=ROOT, stdout=log, stderr=log, env=ENV)
        got, want = _records(run_dir), _records(ref)
    return summarise(dict(kills=kills, signals=signals, steps=steps, seed=seed), outcomes,
                     final.returncode, got, want, time.time() - start)


def summarise(size: dict, outcomes: list, final_rc: int, got: list[dict], want: list[dict], wall_s: float) -> dict:
    """Counts from the faults' outcomes [(signal name, _hit's dict)] and the final and reference records."""
    steps = [r["step"] for r in got]
    hits = [(s, o) for s, o in outcomes if not o["finished"]]
    kills = [o for s, o in hits if s == "SIGKILL"]
    sigs = [(s, o) for s, o in hits if s != "SIGKILL"]
    got_v, want_v = _values(got), _values(want)
    equal = sum(v == want_v.get(st) for st, v in got_v.items())
    return dict(size, planned=len(outcomes), landed=len(hits), kills_landed=len(kills),
                kills_in_save=sum(o["in_save"] for o in kills), children=sum(o["children"] for o in kills),
                leaked=sum(o["left"] for o in kills), signals_landed=len(sigs),
                signal_names=sorted({s for s, _ in sigs}), bad_signals=[(s, o["rc"]) for s, o in sigs if o["rc"] != 0],
                final_rc=final_rc, records=len(got), each_once=steps == list(range(size["steps"] + 1)),
                missing=len(set(want_v) - set(steps)), duplicated=len(steps) - len(set(steps)),
                differing=len(got_v) - equal, equal=equal, reference_records=len(want),
                num_values=sum(len(v) for v in want_v.values()), wall_s=wall_s)


def passed(c: dict) -> bool:
    """The exit status's criterion: the final resume completes with every record once and equal to the
    reference, every stop signal exits 0, and no child process outlives a killed trainer."""
    ok = c["final_rc"] == 0 and c["each_once"] and c["equal"] == c["reference_records"] and not c["bad_signals"]
    return ok and not c["leaked"]


def _figure(figure: str, value: float, unit: str, target: str | None = "0") -> dict:
    return dict(figure=figure, value=float(value), unit=unit, baseline_name=None, baseline=None, ratio=None,
                target=target, met=None if target is None else value == 0)


def figures(c: dict) -> list[dict]:
    """Counts of what went wrong (target 0), and how many kills landed inside a save: no pass
    criterion, it says how hard the campaign hit the checkpoint writer. Records are compared with
    the uninterrupted reference, step by step, all values but wall times; a record whose step the
    reference lacks counts as differing."""
    return [
        _figure("child processes left 20 s after a SIGKILL to the trainer", c["leaked"], "processes"),
        _figure(f"SIGKILLs that landed inside a checkpoint save (of {c['kills_landed']})", c["kills_in_save"],
                "kills", target=None),
        _figure(f"stop signals not exiting 0 (of {c['signals_landed']})", len(c["bad_signals"]), "signals"),
        _figure("final resume exit status", c["final_rc"], "exit code"),
        _figure("metric records missing after the final resume", c["missing"], "records"),
        _figure("metric records duplicated", c["duplicated"], "records"),
        _figure(f"metric records differing from the reference (of {c['reference_records']})", c["differing"],
                "records"),
    ]


def render_markdown(c: dict) -> str:
    bad = ", ".join(f"{s} rc {rc}" for s, rc in c["bad_signals"]) or "none"
    return "\n".join([
        f"CPU demo (conf/cpu_tiny.yaml), {c['steps']} steps, seed {c['seed']}: {c['kills']} SIGKILLs and "
        f"{c['signals']} stop signals planned, {c['landed']} landed ({c['planned'] - c['landed']} runs finished "
        f"first and were started over); wall {c['wall_s']:.0f} s.", "",
        "| fault | landed | outcome |", "|---|---|---|",
        f"| SIGKILL to the trainer alone | {c['kills_landed']} ({c['kills_in_save']} inside a save) | "
        f"{c['children']} child processes alive at the kills, {c['leaked']} left 20 s later |",
        f"| SIGTERM / SIGUSR1 / SIGINT | {c['signals_landed']} | {c['signals_landed'] - len(c['bad_signals'])} "
        f"exited 0; others: {bad} |",
        f"| final resume | - | exit {c['final_rc']}; {c['records']} records for steps 0..{c['steps']}, "
        f"{c['missing']} missing, {c['duplicated']} duplicated, {c['equal']}/{c['reference_records']} equal to "
        f"the reference ({c['num_values']} values) |",
    ]) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (2 kills, 3 stop signals, 24 steps: ~2 min) or FULL (the
    CLI's defaults: 30 kills, 9 signals, 24 steps)."""
    c = campaign(**(QUICK if quick else FULL))
    return dict(name="fault_campaign", figures=figures(c), markdown=render_markdown(c), details=c)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=FULL["kills"])
    p.add_argument("--signals", type=int, default=FULL["signals"])
    p.add_argument("--steps", type=int, default=FULL["steps"])
    p.add_argument("--seed", type=int, default=FULL["seed"])
    args = p.parse_args()
    c = campaign(args.kills, args.signals, args.steps, args.seed)
    print(f"{c['planned']} faults planned, {c['landed']} landed ({c['planned'] - c['landed']} runs finished first "
          "and were started over)")
    print(f"{c['kills_landed']} SIGKILLs to the trainer alone ({c['kills_in_save']} inside a checkpoint "
          f"save), {c['children']} child processes then alive, {c['leaked']} left 20 s after the kill")
    print(f"{c['signals_landed']} stop signals ({', '.join(c['signal_names'])}): "
          f"{c['signals_landed'] - len(c['bad_signals'])} exited 0 with a checkpoint, others: {c['bad_signals']}")
    print(f"final resume rc {c['final_rc']}; records {c['records']} for steps 0..{args.steps} "
          f"(each once: {c['each_once']}); records equal to the reference: {c['equal']}/"
          f"{c['reference_records']} ({c['num_values']} values); wall {c['wall_s']:.0f} s")
    return 0 if passed(c) else 1


if __name__ == "__main__":
    sys.exit(main())
