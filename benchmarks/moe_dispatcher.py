"""megatron's two MoE token dispatchers on a CPU: the MoE demo (conf/cpu_tiny_moe.yaml, EP 2 over 2
processes under torchrun) with ``moe.token_dispatcher=allgather`` (the CPU's default; one shape for every
micro-batch, so packed by default) against ``alltoall`` (the GPU's default; each rank's own shapes, so
padded), the same steps from the same base, alternating, ``--rounds`` times.

Per layout: the median over rounds of the update's seconds per step (``timing_s/train``, steps 2 on: the
first carries set-up) and the ratio to allgather; and step 1's records side by side (the two dispatchers
compute one update: they must agree to fp32 round-off).

    python benchmarks/moe_dispatcher.py --out docs/moe_dispatcher.json   # 3 rounds of 6 steps, ~4 min
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emit import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "cpu_tiny_moe.yaml"
DEMO_DIRS = ("toy", "toy_data", "toy_base")  # the demo's task and warmed-up base, made once, copied into each run
# a child of a launcher must not think it is one rank of many
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
LAYOUTS = {"allgather": ["moe.token_dispatcher=allgather"], "alltoall": ["moe.token_dispatcher=alltoall"]}
SHORT = ["eval.every=0", "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false"]
COMPARED = ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "moe/load_balancing_loss")


def make_base(run_dir: Path) -> Path:
    """``run_dir`` holding the demo's toy task and base model (the trainer's own ``materialise``)."""
    code = ("import sys; from pathlib import Path; from megatron_dapo.config_loading import load_config; "
            "from megatron_dapo.toy.bootstrap import materialise; "
            "cfg = load_config(sys.argv[1], sys.argv[2:]); materialise(cfg, Path(cfg.logging.dir), 0)")
    subprocess.run([sys.executable, "-c", code, str(CONFIG), f"logging.dir={run_dir}"], cwd=ROOT, check=True,
                   capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run_dir


def one_run(run_dir: Path, base: Path, overrides: list[str], steps: int) -> list[dict]:
    """The demo's records for ``steps`` steps in ``run_dir``, from ``base``'s toy task and base model."""
    for part in DEMO_DIRS:
        shutil.copytree(base / part, run_dir / part)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(CONFIG), f"logging.dir={run_dir}",
           f"train.total_steps={steps}", *SHORT, *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measure(rounds: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        base = make_base(Path(tmp) / "base")
        per_step: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        first: dict[str, dict] = {}
        for r in range(rounds):
            for name, overrides in LAYOUTS.items():
                records = one_run(Path(tmp) / f"{name}_{r}", base, overrides, steps)
                per_step[name].append(statistics.median(x["timing_s/train"] for x in records if x["step"] >= 2))
                first[name] = {k: records[0].get(k) for k in COMPARED}
    median = {name: statistics.median(v) for name, v in per_step.items()}
    return {"rounds": rounds, "steps": steps,
            "update_s_per_step": {name: round(v, 4) for name, v in median.items()},
            "update_s_per_step_each_round": per_step,
            "speed_vs_allgather": {name: round(median["allgather"] / v, 2) for name, v in median.items()},
            "step_1_records": first}


def run(quick: bool) -> dict:
    """run_all.py's entry: the update's seconds per step, alltoall against allgather (no target: the CPU's
    default stays allgather, docs/moe.md says why)."""
    result = measure(rounds=1 if quick else 3, steps=3 if quick else 6)
    t = result["update_s_per_step"]
    figures = [dict(figure="MoE demo update s/step at EP 2, alltoall dispatcher", value=t["alltoall"], unit="s",
                    baseline_name="allgather dispatcher (the CPU's default)", baseline=t["allgather"],
                    ratio=t["alltoall"] / t["allgather"], target=None, met=None)]
    rows = ["| dispatcher | update s/step | speed vs allgather |", "|---|---|---|"]
    rows += [f"| {k} | {t[k]:.3f} | {result['speed_vs_allgather'][k]:.2f}x |" for k in LAYOUTS]
    return dict(name="moe_dispatcher", figures=figures, markdown="\n".join(rows), details=result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", help="also write the JSON here (docs/moe_dispatcher.json)")
    args = parser.parse_args(argv)
    return emit(measure(args.rounds, args.steps), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
