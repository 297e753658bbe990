"""How long a checkpoint save stalls training: background writes (checkpoint.async_save) against the
one-phase saves, both through the loop's own saver (megatron_dapo/step_saves.py).

Each mode runs in a fresh process: a MegatronActor (fp32, distributed optimizer, 1 process on CPU)
takes ``--steps`` steps, each ``--updates`` real updates (4 samples of 16 tokens) followed by a save,
as ``checkpoint.save_every=1`` runs them (poll at the step's start, write after the updates, publish
after the record); a third process takes the same steps without saving (the floor). Figures: the
trainer's time blocked by a save (its write and its publish's own work; a wait for a background write
still in flight is counted apart: a step shorter than the write waits at the next save), and the mean
step time, each as a ratio to the one-phase save's. What the background write leaves in the
trainer: the distributed optimizer's gather into its fully reshardable state, megatron's plan and
its clones of the parameter buffers (CPU tensors; on a GPU the copy of the device state to host
memory instead) and the fork; the files' write moves to the child, which shares the machine's cores
and disk with training.

    python benchmarks/async_save.py [--hidden 1024 --layers 8 --steps 4 --updates 3]   # ~160M params: ~5 min
    python benchmarks/async_save.py --hidden 128 --layers 2 --steps 3 --updates 3      # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "sync", "background")
QUICK = dict(hidden=128, layers=2, steps=3, updates=3)
FULL = dict(hidden=1024, layers=8, steps=4, updates=3)


class _State:
    """What StepSaves publishes as the trainer state: the step only."""

    def __init__(self, step: int):
        self.step = step

    def to_json(self) -> dict:
        return {"step": self.step}


def _child(args) -> None:
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # before anything imports megatron.core
    from _ckpt_actor import trained_actor

    from megatron_dapo.step_saves import StepSaves
    from megatron_dapo.time_limit import StepClock

    actor, samples = trained_actor(args.hidden, args.layers)
    steps, blocked, waited = [], [], []
    with tempfile.TemporaryDirectory() as d:
        saves = StepSaves(actor, d, StepClock(), background=args.mode == "background", saved=0)
        for step in range(1, args.steps + 1):
            began = time.perf_counter()
            saves.poll()
            polled = time.perf_counter()
            for _ in range(args.updates):
                actor.get_loss_and_metrics(samples)
            if args.mode != "none":
                flushed = time.perf_counter()
                saves.flush()  # a background write still in flight (write() would wait for it too)
                written = time.perf_counter()
                pending = saves.write(step)
                saves.written(*pending, _State(step))
                blocked.append(polled - began + time.perf_counter() - written)
                waited.append(written - flushed)
            steps.append(time.perf_counter() - began)
        began = time.perf_counter()
        saves.flush()  # the last background write: what the run's end waits for
        final_wait = time.perf_counter() - began
        size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) / (1 << 20) / min(2, args.steps)
    params = sum(p.numel() for c in actor.model for p in c.parameters())
    print(json.dumps(dict(mode=args.mode, steps=steps, blocked=blocked, waited=waited, final_wait=final_wait,
                          mb=size, params=params)))


def measure(hidden: int, layers: int, steps: int, updates: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = dict(hidden=hidden, layers=layers, steps=steps, updates=updates)
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--hidden", str(hidden), "--layers",
                              str(layers), "--steps", str(steps), "--updates", str(updates)], capture_output=True,
                             text=True, env=env, cwd=ROOT, check=True)
        result[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _later(xs: list[float]) -> float:
    """The mean after the first step (the first save plans from scratch; megatron caches nothing here)."""
    return sum(xs[1:]) / (len(xs) - 1) if len(xs) > 1 else xs[0]


def figures(result: dict) -> list[dict]:
    """ratio < 1: the background write stalls training less than the one-phase save."""
    sync, bg = result["sync"], result["background"]
    return [dict(figure="training blocked by a save, per step, background write", value=_later(bg["blocked"]),
                 unit="s", baseline_name="one-phase save", baseline=_later(sync["blocked"]),
                 ratio=_later(bg["blocked"]) / _later(sync["blocked"]), target=None, met=None),
            dict(figure="step time with a save every step, background write", value=_later(bg["steps"]), unit="s",
                 baseline_name="one-phase save", baseline=_later(sync["steps"]),
                 ratio=_later(bg["steps"]) / _later(sync["steps"]), target=None, met=None)]


def render_markdown(result: dict) -> str:
    s = result["sync"]
    lines = [f"A save of {s['mb']:.0f} MB (model + optimizer, {s['params'] / 1e6:.0f}M params, hidden "
             f"{result['hidden']}, {result['layers']} layers, fp32) after every one of {result['steps']} steps "
             f"({result['updates']} updates of 4 x 16 tokens each), 1 process on CPU, each mode in a fresh process; "
             "means over the steps after the first, s.", "",
             "| saves | step | blocked by the save | waited for the previous write | the run's end waited |",
             "|---|---|---|---|---|"]
    for name, key in (("none", "none"), ("one-phase", "sync"), ("background", "background")):
        r = result[key]
        blocked, waited = ((f"{_later(r[k]):.3f}" if r[k] else "-") for k in ("blocked", "waited"))
        lines.append(f"| {name} | {_later(r['steps']):.3f} | {blocked} | {waited} | {r['final_wait']:.3f} |")
    return "\n".join(lines) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (hidden 128, 2 layers, 3 steps of 3 updates: ~1 min) or FULL
    (the CLI's defaults)."""
    result = measure(**(QUICK if quick else FULL))
    return dict(name="async_save", figures=figures(result), markdown=render_markdown(result), details=result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=FULL["hidden"])
    p.add_argument("--layers", type=int, default=FULL["layers"])
    p.add_argument("--steps", type=int, default=FULL["steps"])
    p.add_argument("--updates", type=int, default=FULL["updates"], help="updates per step")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        _child(args)
        return 0
    result = measure(args.hidden, args.layers, args.steps, args.updates)
    print(render_markdown(result))
    for f in figures(result):
        print(f"{f['figure']}: {f['value']:.3f} {f['unit']} against {f['baseline']:.3f} ({f['ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
