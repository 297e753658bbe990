"""Host memory of one checkpoint save with the distributed optimizer: megatron's memory-efficient
fully-reshardable gather (checkpoint.memory_efficient_save, the default) against the plain one.

megatron-core 0.19.2 turns the distributed optimizer's flat DP shards into its ``fully_reshardable``
format by gathering the fp32 param and Adam moments of the whole TP x PP shard into CPU tensors:
without ``distrib_optim_fully_reshardable_mem_efficient`` on every DP rank (all_gather), with it on
DP rank 0 only (a gloo gather; the other ranks keep only their own shard). Both runs here are 2
processes under torchrun on gloo (TP = PP = 1, DP = 2, fp32, torch AdamW), the same model and one
real update first, so the optimizer state exists; each mode runs in fresh processes.

Per rank: the peak RSS during the save (Linux VmHWM, reset through /proc/self/clear_refs right
before it, after gc and malloc_trim) minus the RSS just before it, and the same for loading the
checkpoint back (the load does not depend on the flag: megatron builds the whole state on every
rank either way). Figures: the save's extra memory summed over the 2 ranks (what one host with
both ranks needs) and on DP rank 1, memory-efficient / plain; the save time.

    python benchmarks/checkpoint_memory.py [--hidden 1024 --layers 8]   # ~160M params: ~3 min
    python benchmarks/checkpoint_memory.py --hidden 128 --layers 2        # seconds
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

from _rss import reset_peak, rss_mb

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "memory_efficient")
QUICK = dict(hidden=128, layers=2)
FULL = dict(hidden=1024, layers=8)


# -- inside a torchrun rank ------------------------------------------------------------------------

def _measured(fn) -> dict:
    reset_peak()
    base, start = rss_mb(), time.perf_counter()
    fn()
    return dict(extra_mb=rss_mb("VmHWM") - base, base_mb=base, seconds=time.perf_counter() - start)


def _rank(args) -> None:
    import torch

    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # before anything imports megatron.core
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    from _ckpt_actor import trained_actor

    from megatron_dapo.mcore import checkpoint, destroy_parallel

    actor, _ = trained_actor(args.hidden, args.layers)
    rank = torch.distributed.get_rank()
    params = sum(p.numel() for c in actor.model for p in c.parameters())
    save = _measured(lambda: checkpoint.save_checkpoint(
        args.dir, 1, model=actor.model, optimizer=actor.optimizer, scheduler=actor.scheduler,
        trainer_state={"step": 1}, keep_last=1, memory_efficient=args.mode == "memory_efficient"))
    load = _measured(lambda: actor.load_checkpoint(args.dir))
    (Path(args.dir).parent / f"rank_{rank}.json").write_text(json.dumps(dict(rank=rank, params=params,
                                                                              save=save, load=load)))
    destroy_parallel()


# -- the parent ------------------------------------------------------------------------------------

def measure(hidden: int, layers: int) -> dict:
    """Both modes, each in 2 fresh torchrun processes: {mode: [rank 0's record, rank 1's]}."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = dict(hidden=hidden, layers=layers)
    for mode in MODES:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--mode", mode, "--dir", str(Path(d) / "ckpt"), "--hidden", str(hidden),
                   "--layers", str(layers)]
            subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
            result[mode] = [json.loads((Path(d) / f"rank_{r}.json").read_text()) for r in (0, 1)]
    return result


def _figure(figure: str, value: float, baseline: float, unit: str) -> dict:
    return dict(figure=figure, value=value, unit=unit, baseline_name="plain fully_reshardable gather",
                baseline=baseline, ratio=value / baseline if baseline else None, target=None, met=None)


def figures(result: dict) -> list[dict]:
    """ratio < 1: the memory-efficient save needs less (memory) or is faster (time)."""
    plain, eff = result["plain"], result["memory_efficient"]
    total = [sum(r["save"]["extra_mb"] for r in runs) for runs in (eff, plain)]
    return [_figure("checkpoint save host memory, 2 DP ranks together, memory-efficient", *total, "MiB"),
            _figure("checkpoint save host memory, DP rank 1, memory-efficient", eff[1]["save"]["extra_mb"],
                    plain[1]["save"]["extra_mb"], "MiB"),
            _figure("checkpoint save time, memory-efficient", eff[0]["save"]["seconds"],
                    plain[0]["save"]["seconds"], "s")]


def render_markdown(result: dict) -> str:
    params = result["plain"][0]["params"]
    lines = [f"One save of {params / 1e6:.0f}M params per rank (hidden {result['hidden']}, "
             f"{result['layers']} layers, fp32, distributed optimizer), TP = PP = 1, DP = 2, torchrun on "
             "gloo, CPU. Extra host memory = peak RSS during the save (or load) minus the RSS before it, "
             "MiB.", "",
             "| mode | rank | RSS before | save extra | save s | load extra |", "|---|---|---|---|---|---|"]
    for mode in MODES:
        for r in result[mode]:
            save, load = r["save"], r["load"]
            lines.append(f"| {mode} | {r['rank']} | {save['base_mb']:.0f} | {save['extra_mb']:.0f} | "
                         f"{save['seconds']:.2f} | {load['extra_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (hidden 128, 2 layers: ~1 min) or FULL (the CLI's defaults)."""
    result = measure(**(QUICK if quick else FULL))
    return dict(name="checkpoint_memory", figures=figures(result), markdown=render_markdown(result),
                details=result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=FULL["hidden"])
    p.add_argument("--layers", type=int, default=FULL["layers"])
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a torchrun rank
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        _rank(args)
        return 0
    result = measure(args.hidden, args.layers)
    print(render_markdown(result))
    for f in figures(result):
        print(f"{f['figure']}: {f['value']:.2f} {f['unit']} vs {f['baseline']:.2f} (ratio {f['ratio']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
