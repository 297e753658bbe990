"""Time and peak memory of HF <-> Megatron conversion vs a plain safetensors read + write of the same bytes.

For each Qwen2.5 shape (real dimensions, random bf16 weights written by this script):
  baseline        every shard read with safe_open, tensor by tensor, and written back with save_file
                  (one shard in memory at a time): the I/O floor of any converter
  hf_to_megatron  megatron_dapo.policy.hf_conversion.hf_to_megatron (TP=1, torch_dist checkpoint)
  megatron_to_hf  megatron_dapo.policy.hf_conversion.megatron_to_hf (back to sharded safetensors)
then checks that the round trip is bit-exact. Each step runs in its own process; peak RSS is that
process's ru_maxrss (the dist-checkpoint writer's helper process is not counted), and "after imports"
is its RSS before any weight is touched. Ratios are against the baseline measured in the same run.

    python benchmarks/convert.py                  # Qwen2.5-0.5B shape (~1 GB of bf16), about 1-2 min
    python benchmarks/convert.py --sizes 0.5B 1.5B  # + the 1.5B shape (~3 GB), a few minutes more
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_gb() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 1e9


def _step(name: str, src: str, dst: str, size: str, shard_bytes: int) -> dict:
    import torch  # noqa: F401  (counted in "after imports" for every step)

    if name in ("hf_to_megatron", "megatron_to_hf"):
        from megatron_dapo.convert import checkpoint as ckpt
    from megatron_dapo.convert import SafetensorsReader
    from megatron_dapo.convert.synthetic import QWEN25_CONFIGS, write_random_hf_checkpoint
    from safetensors import safe_open
    from safetensors.torch import save_file

    after_imports = _rss_gb()
    start, cpu = time.perf_counter(), time.process_time()
    result: dict = {}
    if name == "make":
        import torch
        result["bytes"] = write_random_hf_checkpoint(QWEN25_CONFIGS[size], dst, dtype=torch.bfloat16,
                                                     max_shard_bytes=shard_bytes)
    elif name == "baseline":
        os.makedirs(dst, exist_ok=True)
        for file in sorted(Path(src).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_file(tensors, Path(dst) / file.name, metadata={"format": "pt"})
            del tensors
    elif name == "hf_to_megatron":
        ckpt.hf_to_megatron(src, dst, progress=False)
    elif name == "megatron_to_hf":
        ckpt.megatron_to_hf(src, dst, max_shard_bytes=shard_bytes, progress=False)
    elif name == "compare":
        with SafetensorsReader(src) as a, SafetensorsReader(dst) as b:
            assert sorted(a.names()) == sorted(b.names()), "tensor names differ"
            bad = [n for n in a.names() if not a.get(n).equal(b.get(n))]
        result["bit_exact"] = not bad
        result["mismatched"] = bad[:5]
    result.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu,
                  after_imports_gb=after_imports,
                  peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    return result


def run_step(name: str, src, dst, size: str, shard_bytes: int) -> dict:
    cmd = [sys.executable, __file__, "--step", name, "--src", str(src), "--dst", str(dst), "--sizes", size,
           "--shard-gb", str(shard_bytes / 1e9)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"step {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["0.5B"], choices=["0.5B", "1.5B"],
                   help="Qwen2.5 shapes to convert (larger ones: hf_to_megatron.py --dry-run)")
    p.add_argument("--shard-gb", type=float, default=0.5,
                   help="safetensors shard size of the made and exported dirs")
    p.add_argument("--workdir", help="where to write checkpoints (default: a temporary dir, deleted after)")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shard_bytes = int(args.shard_gb * 1e9)
    if args.step:
        if args.step in ("hf_to_megatron", "megatron_to_hf"):
            os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        print(json.dumps(_step(args.step, args.src, args.dst, args.sizes[0], shard_bytes)))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    rows = []
    try:
        for size in args.sizes:
            d = work / size
            shutil.rmtree(d, ignore_errors=True)
            made = run_step("make", None, d / "hf", size, shard_bytes)
            base = run_step("baseline", d / "hf", d / "copy", size, shard_bytes)
            to_mc = run_step("hf_to_megatron", d / "hf", d / "ckpt", size, shard_bytes)
            to_hf = run_step("megatron_to_hf", d / "ckpt", d / "out", size, shard_bytes)
            check = run_step("compare", d / "hf", d / "out", size, shard_bytes)
            rows.append((size, made["bytes"], base, to_mc, to_hf, check))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print(f"{'shape':<6} {'step':<16} {'wall s':>7} {'cpu s':>7} {'peak RSS GB':>12} {'after imports':>14} "
          f"{'x base time':>12} {'x base RSS':>11}")
    for size, nbytes, base, to_mc, to_hf, check in rows:
        for name, r in (("baseline r+w", base), ("hf_to_megatron", to_mc), ("megatron_to_hf", to_hf)):
            print(f"{size:<6} {name:<16} {r['seconds']:>7.1f} {r['cpu_seconds']:>7.1f} "
                  f"{r['peak_rss_gb']:>12.2f} {r['after_imports_gb']:>14.2f} "
                  f"{r['seconds'] / base['seconds']:>12.2f} {r['peak_rss_gb'] / base['peak_rss_gb']:>11.2f}")
        exact = check["bit_exact"] or check["mismatched"]
        print(f"{size:<6} weights {nbytes / 1e9:.2f} GB (bf16), shards of {args.shard_gb} GB; "
              f"round trip bit-exact: {exact}")
    return 0 if all(r[-1]["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
