"""What megatron's writer-results Manager process costs a synchronous checkpoint save (issue 14).

megatron-core's sync ``dist_checkpointing.save`` writes in the calling process (threads), but hands
the write results back through a queue that it gets from a ``multiprocessing.Manager`` server
process, spawned on the first save and alive until the trainer exits (and past it, after a
SIGKILL). policy/checkpoint.py gives it a plain in-process queue instead. This benchmark saves the
same actor (optimizer included) ``--saves`` times both ways, in fresh processes, and reports the
first save, the later saves and the ratio.

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
    from megatron_dapo.policy.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # before anything imports megatron.core
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.config_loading import load_config
    from megatron_dapo.policy import checkpoint
    from megatron_dapo.policy.actor import MegatronActor

    if args.mode == "manager":  # megatron's own behaviour: its Manager-backed queue
        checkpoint.in_process_write_results = lambda: None
    hf = dict(model_type="qwen2", vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
              num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6,
              rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=1024, hidden_act="silu")
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--mode", choices=("in_process", "manager"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        _child(args)
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    results = {}
    for mode in ("manager", "in_process"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--hidden", str(args.hidden),
                              "--layers", str(args.layers), "--saves", str(args.saves)],
                             capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    m, i = results["manager"], results["in_process"]
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
