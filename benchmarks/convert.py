"""Time and peak memory of HF <-> Megatron conversion vs a plain safetensors read + write of the same bytes.

For each shape (real Qwen2.5 dimensions, or "tiny" for a quick run; random bf16 weights written by
this script):
  baseline        every shard read with safe_open, tensor by tensor, and written back with save_file
                  (one shard in memory at a time): the I/O floor of any converter
  hf_to_megatron  megatron_dapo.mcore.hf_conversion.hf_to_megatron (torch_dist checkpoint); with
                  ``--workers 1 2 ...`` once per worker count: W processes under torchrun at PP=W,
                  each reading and writing its stages' tensors
  megatron_to_hf  megatron_dapo.mcore.hf_conversion.megatron_to_hf (back to sharded safetensors);
                  with ``--workers`` once per count: W processes it spawns, each writing every W-th
                  output shard
  export          ``megatron-dapo export`` (mcore/run_export.py) of a training run's checkpoint holding
                  the same weights (written once, untimed, by the trainer's own save: bf16 model, no
                  optimizer state), back to safetensors in bf16
then checks that the round trip and the export are bit-exact. Each step runs in its own process; peak RSS is that
process's ru_maxrss (rank 0's under torchrun, the first process's with spawned workers), and
"after imports" is its RSS before any weight is touched; the wall time excludes the imports.
Ratios are against the baseline measured in the same run.

Targets: each direction's wall time at most 2x the baseline's (a direction reads and writes the
bytes once, as the baseline does), and each step's peak RSS at most its own "after imports" plus
one input shard (the largest HF shard file) plus the largest tensor. Seconds per GB at each worker
count are projected to a Qwen2.5-32B checkpoint (65.5 GB) as if linear in its size.

    python benchmarks/convert.py                  # Qwen2.5-0.5B shape (~1 GB of bf16), about 1-2 min
    python benchmarks/convert.py --sizes 1.5B 7B --workers 1 2   # the issue's shapes (~3 and ~15 GB)
    python benchmarks/convert.py --sizes tiny --shard-gb 0.016   # seconds
    python benchmarks/convert.py --profile        # + where each conversion's time and memory go

``--profile`` runs each conversion under cProfile with its RSS sampled every 20 ms, and prints
the functions with the most cumulative time and the RSS timeline (which phase holds the peak).
Profiling slows the steps down: compare times from runs without it.
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

SIZES = ("tiny", "0.5B", "1.5B", "7B")
ROOT = Path(__file__).resolve().parents[1]
# "tiny": the 0.5B config at a size a quick run converts in seconds (25 MB of bf16)
TINY = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32000)
TIME_TARGET = 2.0  # a direction's wall time / baseline read + write
BYTES_32B = 65.5e9  # Qwen2.5-32B's bf16 checkpoint: the projection's size
QUICK = dict(sizes=("tiny",), shard_gb=0.016)
FULL = dict(sizes=("0.5B", "1.5B"), shard_gb=0.5)


def _rss_gb() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 1e9


def _make(size: str, dst: str, shard_bytes: int) -> dict:
    import torch
    from safetensors import safe_open

    from megatron_dapo.convert.synthetic import QWEN25_CONFIGS, write_random_hf_checkpoint

    config = {**QWEN25_CONFIGS["0.5B"], **TINY} if size == "tiny" else QWEN25_CONFIGS[size]
    nbytes = write_random_hf_checkpoint(config, dst, dtype=torch.bfloat16, max_shard_bytes=shard_bytes)
    files = sorted(Path(dst).glob("*.safetensors"))
    largest = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                largest = max(largest, 2 * int(torch.tensor(shape).prod()))  # bf16: 2 bytes
    return dict(bytes=nbytes, largest_shard_bytes=max(f.stat().st_size for f in files),
                largest_tensor_bytes=largest)


PROFILE_TOP = 25  # functions listed per profiled step
RSS_PERIOD_S = 0.02


def _run_config(hf: str, run_dir: str):
    from megatron_dapo.config_loading import load_config

    return load_config(ROOT / "conf" / "cpu_tiny.yaml", ["toy.enable=false", f"model.hf_path={hf}",
                                                         f"logging.dir={run_dir}", "model.dtype=bf16"])


def _make_run(hf: str, run_dir: str) -> None:
    """A training run's checkpoint of ``hf``'s weights, as the trainer saves it (step 1, no optimizer)."""
    from megatron_dapo.convert.export import load_hf_weights
    from megatron_dapo.convert.safetensors_io import SafetensorsReader, read_hf_config
    from megatron_dapo.mcore.checkpoint import save_checkpoint
    from megatron_dapo.mcore.model import build_model, conversion_table_for
    from megatron_dapo.mcore.parallel import destroy_parallel, initialize_parallel

    cfg, config = _run_config(hf, run_dir), read_hf_config(hf)
    initialize_parallel(config, parallel=cfg.parallel, model=cfg.model, seed=0)
    chunks = build_model(config, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe, perform_initialization=False)
    with SafetensorsReader(hf) as reader:
        load_hf_weights(chunks, conversion_table_for(config, model=cfg.model, tp=1), reader)
    save_checkpoint(cfg.checkpoint_root, 1, model=chunks, optimizer=None, scheduler=None,
                    trainer_state={"step": 1}, keep_last=1)
    destroy_parallel()


def _profiled(fn) -> dict:
    """Run ``fn()`` under cProfile with a thread sampling RSS; the top functions by cumulative
    time and the RSS timeline (one point per ~0.25 s, plus the peak sample)."""
    import cProfile
    import pstats
    import threading

    import psutil

    proc, samples, done = psutil.Process(), [], threading.Event()
    start = time.perf_counter()

    def sample():
        while not done.is_set():
            samples.append((time.perf_counter() - start, proc.memory_info().rss / 1e9))
            done.wait(RSS_PERIOD_S)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    profile = cProfile.Profile()
    try:
        profile.runcall(fn)
    finally:
        done.set()
        thread.join()
    stats = pstats.Stats(profile).stats
    rows = sorted(((ct, tt, nc, f"{Path(file).name}:{line}({func})")
                   for (file, line, func), (_, nc, tt, ct, _) in stats.items()), reverse=True)[:PROFILE_TOP]
    timeline, last = [], -1.0
    peak = max(samples, key=lambda s: s[1], default=(0.0, 0.0))
    for t, rss in samples:
        if t - last >= 0.25 or (t, rss) == peak:
            timeline.append((round(t, 2), round(rss, 3)))
            last = t
    return dict(top=[dict(cum_s=ct, own_s=tt, calls=nc, function=f) for ct, tt, nc, f in rows],
                rss_timeline=timeline, rss_peak_at_s=round(peak[0], 2))


def _step(name: str, src: str, dst: str, size: str, shard_bytes: int, profile: bool = False,
          workers: int = 1) -> dict:
    import torch  # noqa: F401  (counted in "after imports" for every step)

    if name in ("hf_to_megatron", "megatron_to_hf", "export", "make_run"):  # megatron.core: part of "the imports"
        from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
        apply_cpu_compat()
        from megatron.core import dist_checkpointing  # noqa: F401

        from megatron_dapo.mcore import hf_conversion as ckpt
        from megatron_dapo.mcore.run_export import export_run
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_dapo.convert import SafetensorsReader

    after_imports = _rss_gb()
    start, cpu = time.perf_counter(), time.process_time()
    result: dict = {}
    if name == "make":
        result = _make(size, dst, shard_bytes)
    elif name == "baseline":
        os.makedirs(dst, exist_ok=True)
        for file in sorted(Path(src).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_file(tensors, Path(dst) / file.name, metadata={"format": "pt"})
            del tensors
    elif name == "make_run":
        _make_run(src, dst)
    elif name in ("hf_to_megatron", "megatron_to_hf", "export"):
        def convert():
            if name == "export":
                export_run(_run_config(Path(src).parent / "hf", src), dst, dtype="bf16", progress=False)
            elif name == "hf_to_megatron":
                ckpt.hf_to_megatron(src, dst, pp=workers, progress=False)
            else:
                ckpt.megatron_to_hf(src, dst, max_shard_bytes=shard_bytes, progress=False, workers=workers)

        if profile:
            result = _profiled(convert)
        else:
            convert()
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


def run_step(name: str, src, dst, size: str, shard_bytes: int, profile: bool = False, workers: int = 1) -> dict:
    torchrun = workers > 1 and name == "hf_to_megatron"  # megatron_to_hf spawns its own workers
    launch = [sys.executable] if not torchrun else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc-per-node={workers}"]
    cmd = [*launch, __file__, "--step", name, "--src", str(src), "--dst", str(dst), "--sizes", size,
           "--shard-gb", str(shard_bytes / 1e9), "--workers", str(workers)] + (["--profile"] if profile else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if torchrun:  # each process's share of the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"step {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(sizes, shard_gb: float, workdir: str | None = None, profile: bool = False,
            workers=(1,)) -> dict:
    """Every step of every shape, each in its own process; checkpoints deleted after each shape.
    hf_to_megatron runs once per worker count (the round trip reads the one-worker checkpoint)."""
    shard_bytes = int(shard_gb * 1e9)
    work = Path(workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    shapes = {}
    try:
        for size in sizes:
            d = work / size
            shutil.rmtree(d, ignore_errors=True)
            made = run_step("make", None, d / "hf", size, shard_bytes)
            steps = dict(baseline=run_step("baseline", d / "hf", d / "copy", size, shard_bytes))
            shutil.rmtree(d / "copy", ignore_errors=True)
            for w in sorted(set(workers) - {1}):
                steps[f"hf_to_megatron x{w}"] = run_step("hf_to_megatron", d / "hf", d / f"ckpt{w}", size,
                                                         shard_bytes, workers=w)
                shutil.rmtree(d / f"ckpt{w}", ignore_errors=True)
            steps["hf_to_megatron"] = run_step("hf_to_megatron", d / "hf", d / "ckpt", size, shard_bytes, profile)
            for w in sorted(set(workers) - {1}):
                steps[f"megatron_to_hf x{w}"] = run_step("megatron_to_hf", d / "ckpt", d / f"out{w}", size,
                                                         shard_bytes, workers=w)
                shutil.rmtree(d / f"out{w}", ignore_errors=True)
            steps["megatron_to_hf"] = run_step("megatron_to_hf", d / "ckpt", d / "out", size, shard_bytes,
                                               profile)
            check = run_step("compare", d / "hf", d / "out", size, shard_bytes)
            shutil.rmtree(d / "ckpt", ignore_errors=True)
            shutil.rmtree(d / "out", ignore_errors=True)
            run_step("make_run", d / "hf", d / "run", size, shard_bytes)
            steps["export"] = run_step("export", d / "run", d / "exported", size, shard_bytes)
            exported = run_step("compare", d / "hf", d / "exported", size, shard_bytes)
            for r in steps.values():  # the memory target: imports + one input shard + the largest tensor
                r["bound_gb"] = r["after_imports_gb"] + (made["largest_shard_bytes"]
                                                         + made["largest_tensor_bytes"]) / 1e9
            shapes[size] = dict(made=made, steps=steps, bit_exact=check["bit_exact"] and exported["bit_exact"],
                                mismatched=check["mismatched"] + exported["mismatched"])
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if not workdir:
            shutil.rmtree(work, ignore_errors=True)
    return dict(shard_gb=shard_gb, workers=sorted(set(workers)), shapes=shapes)


def render_markdown(result: dict) -> str:
    lines = ["| shape | step | wall s | s / GB | 32B projected s | CPU s | peak RSS GB | after imports GB "
             "| x baseline time | memory bound GB | x bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for size, s in result["shapes"].items():
        base = s["steps"]["baseline"]
        for name, r in s["steps"].items():
            label = "baseline read + write" if name == "baseline" else name
            per_gb = r["seconds"] / (s["made"]["bytes"] / 1e9)
            lines.append(f"| {size} | {label} | {r['seconds']:.3g} | {per_gb:.3g} | {per_gb * BYTES_32B / 1e9:.0f} | "
                         f"{r['cpu_seconds']:.3g} | "
                         f"{r['peak_rss_gb']:.2f} | {r['after_imports_gb']:.2f} | "
                         f"{r['seconds'] / base['seconds']:.2f}x | {r['bound_gb']:.2f} | "
                         f"{r['peak_rss_gb'] / r['bound_gb']:.2f}x |")
        m = s["made"]
        notes.append(f"{size}: {m['bytes'] / 1e9:.3f} GB of bf16 weights, largest shard "
                     f"{m['largest_shard_bytes'] / 1e9:.3f} GB, largest tensor "
                     f"{m['largest_tensor_bytes'] / 1e9:.3f} GB; "
                     f"round trip and export bit-exact: {s['bit_exact'] or s['mismatched']}")
    return "\n".join(lines) + (
        f"\n\nShards of at most {result['shard_gb']} GB. Memory bound = the step's RSS after imports + "
        f"the largest input HF shard + the largest tensor. \"x W\": W processes (hf_to_megatron under torchrun "
        f"at PP=W, megatron_to_hf spawning them), the first one's RSS. The 32B projection scales this shape's "
        f"seconds per GB to 65.5 GB.\n"
        + "\n".join(f"- {n}" for n in notes) + "\n" + render_profiles(result))


def render_profiles(result: dict) -> str:
    """The ``--profile`` sections: top functions and RSS timeline of each profiled step."""
    out = []
    for size, s in result["shapes"].items():
        for name, r in s["steps"].items():
            if "top" not in r:
                continue
            title = (f"\n### {size} {name}: cProfile, top {len(r['top'])} by cumulative time "
                     f"(profiled wall {r['seconds']:.2f} s)\n")
            out += [title, "| cum s | own s | calls | function |", "|---|---|---|---|"]
            out += [f"| {t['cum_s']:.3f} | {t['own_s']:.3f} | {t['calls']} | `{t['function']}` |"
                    for t in r["top"]]
            points = ", ".join(f"{t:.2f}s {rss:.2f}" for t, rss in r["rss_timeline"])
            out.append(f"\nRSS GB over time (peak sample at {r['rss_peak_at_s']} s): {points}\n")
    return "\n".join(out)


def figures(result: dict) -> list[dict]:
    out = []
    for size, s in result["shapes"].items():
        steps = s["steps"]
        base = steps["baseline"]["seconds"]
        for name in (n for n in steps if n != "baseline"):
            wall = steps[name]["seconds"]
            out.append(dict(figure=f"{size} {name}, wall", value=wall, unit="s",
                            baseline_name="plain safetensors read + write", baseline=base, ratio=wall / base,
                            target=f"<= {TIME_TARGET}x baseline", met=wall <= TIME_TARGET * base))
        for name in ("hf_to_megatron", "megatron_to_hf", "export"):
            r = steps[name]
            out.append(dict(figure=f"{size} {name} peak RSS", value=r["peak_rss_gb"], unit="GB",
                            baseline_name="bound: imports + one input shard + largest tensor",
                            baseline=r["bound_gb"], ratio=r["peak_rss_gb"] / r["bound_gb"],
                            target="<= 1.0x bound", met=r["peak_rss_gb"] <= r["bound_gb"]))
        out.append(dict(figure=f"{size} round trip and export bit-exact", value=float(s["bit_exact"]), unit="bool",
                        baseline_name=None, baseline=None, ratio=None, target="bit-exact",
                        met=s["bit_exact"]))
    return out


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (the tiny shape, seconds) or FULL (0.5B and 1.5B, minutes)."""
    size = QUICK if quick else FULL
    result = measure(size["sizes"], size["shard_gb"])
    return dict(name="convert", figures=figures(result), markdown=render_markdown(result), details=result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["0.5B"], choices=SIZES,
                   help="shapes to convert (larger ones: hf_to_megatron.py --dry-run)")
    p.add_argument("--shard-gb", type=float, default=FULL["shard_gb"],
                   help="safetensors shard size of the made and exported dirs")
    p.add_argument("--workdir", help="where to write checkpoints (default: a temporary dir, deleted after)")
    p.add_argument("--workers", nargs="+", type=int, default=[1],
                   help="process counts to time each direction at (hf_to_megatron: PP = the count, which must "
                        "divide the layers)")
    p.add_argument("--profile", action="store_true",
                   help="profile each conversion (cProfile + RSS timeline): where time and memory go")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        if args.step in ("hf_to_megatron", "megatron_to_hf"):
            os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        done = _step(args.step, args.src, args.dst, args.sizes[0], int(args.shard_gb * 1e9), args.profile,
                     args.workers[0])
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(done))
        return 0
    result = measure(args.sizes, args.shard_gb, args.workdir, args.profile, args.workers)
    print(render_markdown(result))
    return 0 if all(s["bit_exact"] for s in result["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
