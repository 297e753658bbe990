"""What megatron's writer-results Manager process costs a synchronous checkpoint save.

megatron-core's sync ``dist_checkpointing.save`` writes in the calling process (threads), but hands
the write results back through a queue that it gets from a ``multiprocessing.Manager`` server
process, spawned on the first save and alive until the trainer exits (and past it, after a
SIGKILL). mcore/checkpoint.py gives it a plain in-process queue instead. This benchmark saves the
same actor (optimizer included) ``--saves`` times both ways, in fresh processes, and reports the
first save, the later saves and the ratio. ``run(quick)`` (benchmarks/run_all.py) gives the same
figures at a tiny size (quick) or at these defaults.

    python benchmarks/checkpoint_save.py [--hidden 512 --layers 4 --saves 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(args) -> None:
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # before anything imports megatron.core
    from _ckpt_actor import qwen2_shape
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.config_loading import load_config
    from megatron_dapo.mcore import checkpoint
    from megatron_dapo.mcore.actor import MegatronActor

    if args.mode == "manager":  # megatron's own behaviour: its Manager-backed queue
        checkpoint.in_process_write_results = lambda: None
    hf = qwen2_shape(args.hidden, args.layers)
    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml")
    actor = MegatronActor(cfg, hf)
    times = []
    with tempfile.TemporaryDirectory() as d:
        for step in range(1, args.saves + 1):
            start = time.perf_counter()
            actor.save_checkpoint(d, {"step": step})
            times.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) / (1 << 20) / 2  # keep_last=2
    manager = filesystem_async._results_queue is not None and not hasattr(filesystem_async._results_queue, "mutex")
    print(json.dumps({"mode": args.mode, "times": times, "mb": size, "manager_process": manager}))


QUICK = dict(hidden=64, layers=2, saves=2)
FULL = dict(hidden=512, layers=4, saves=3)


def measure(hidden: int, layers: int, saves: int) -> dict:
    """Both modes, each in a fresh process (the Manager is spawned once per process, on the first save)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = dict(hidden=hidden, layers=layers, saves=saves)
    for mode in ("manager", "in_process"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--hidden", str(hidden),
                              "--layers", str(layers), "--saves", str(saves)],
                             capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        result[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _later(times: list[float]) -> float | None:
    """Mean of the saves after the first (None with one save: nothing to average)."""
    return sum(times[1:]) / (len(times) - 1) if len(times) > 1 else None


def _figure(figure: str, value: float | None, baseline: float | None) -> dict:
    ratio = value / baseline if value is not None and baseline else None
    return dict(figure=figure, value=value, unit="s", baseline_name="megatron's Manager-backed queue",
                baseline=baseline, ratio=ratio, target=None, met=None)


def figures(result: dict) -> list[dict]:
    """First save (the one that spawns megatron's Manager) and the mean of the later saves, with the
    in-process queue against the Manager-backed queue: ratio < 1 means the in-process queue is faster."""
    m, i = result["manager"]["times"], result["in_process"]["times"]
    out = [_figure("first checkpoint save, in-process queue", i[0], m[0])]
    if len(i) > 1:
        out.append(_figure("later checkpoint saves (mean), in-process queue", _later(i), _later(m)))
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_markdown(result: dict) -> str:
    i = result["in_process"]
    lines = [f"Checkpoint of {i['mb']:.0f} MB (model + optimizer), {result['saves']} saves, hidden "
             f"{result['hidden']}, {result['layers']} layers, 1 process on CPU, each mode in a fresh process.",
             "", "| queue | first save s | later saves s (mean) | helper process |", "|---|---|---|---|"]
    for name, key in (("megatron (Manager)", "manager"), ("in-process queue", "in_process")):
        r = result[key]
        lines.append(f"| {name} | {_s(r['times'][0])} | {_s(_later(r['times']))} | "
                     f"{'yes' if r['manager_process'] else 'no'} |")
    return "\n".join(lines) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (hidden 64, 2 layers, 2 saves: ~1 min) or FULL (the CLI's
    defaults: hidden 512, 4 layers, 3 saves)."""
    result = measure(**(QUICK if quick else FULL))
    return dict(name="checkpoint_save", figures=figures(result), markdown=render_markdown(result),
                details=result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=FULL["hidden"])
    p.add_argument("--layers", type=int, default=FULL["layers"])
    p.add_argument("--saves", type=int, default=FULL["saves"])
    p.add_argument("--mode", choices=("in_process", "manager"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        _child(args)
        return 0
    result = measure(args.hidden, args.layers, args.saves)
    m, i = result["manager"], result["in_process"]
    print(f"checkpoint of {i['mb']:.0f} MB (model + optimizer), {args.saves} saves, hidden {args.hidden}, "
          f"{args.layers} layers, 1 process on CPU")
    print(f"{'':22}{'first save s':>14}{'later saves s':>15}{'helper process':>16}")
    for name, r in (("megatron (Manager)", m), ("in-process queue", i)):
        later = sum(r["times"][1:]) / max(1, len(r["times"]) - 1)
        print(f"{name:22}{r['times'][0]:>14.3f}{later:>15.3f}{'yes' if r['manager_process'] else 'no':>16}")
    print(f"first save: in-process / Manager = {i['times'][0] / m['times'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
