"""Rollout engines on this machine: HF transformers vs vLLM's CPU build, side by side in one run.

Three measurements, each engine in its own fresh process (vLLM binds OpenMP threads per process):
  generate     generated tokens/s on the CPU demo's model shape (cpu_tiny_vllm: hidden 64, 2 layers,
               head_dim 32) for one generation batch of the demo (24 prompts x 8 responses) with EOS
               off, so both engines produce exactly the same number of tokens; best of --repeats
               after one warm-up call; vLLM's start-up and warm-up are reported apart
  weight sync  seconds per 100 MB of update_weights (HF names, full tensors, 512 MB buckets) on a
               larger Qwen2 shape (hidden 512, 8 layers, vocabulary 32k: ~230 MB fp32), against the
               baseline of a plain in-memory copy of the same bytes
  DAPO step    seconds per step of conf/cpu_tiny_vllm.yaml under `torchrun --nproc-per-node 2` with
               rollout.engine=hf and =vllm (mean of timing_s/step after step 1, which holds
               warm-ups; wall time of the whole run, start-up included, alongside); both runs start
               from the same toy base, made once

    python benchmarks/rollout.py                    # everything, ~4-6 min on 2 cores
    python benchmarks/rollout.py --skip-train       # engines only, ~1-2 min

``run(quick)`` (benchmarks/run_all.py) gives the ratios as figures: engines only with one repeat
(quick), or everything at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
LARGE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)


def _save_qwen2(path: Path, shape: dict) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # No EOS id at all: vLLM would otherwise stop at the config's EOS whatever the request says.
    cfg = Qwen2Config(**shape, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None,
                      bos_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def _engine(kind: str, path: Path, shape: dict):
    """A fresh engine with EOS off (every response runs to max_tokens)."""
    if kind == "hf":
        from megatron_dapo.rollout.hf_engine import HFEngine

        return HFEngine.from_pretrained(str(path), eos_token_ids=())
    import torch.distributed as dist

    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    if not dist.is_initialized():  # a one-process world, as a torchrun rank would have
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    kv_bytes = 64 << 20 if shape is TINY else 256 << 20
    return VLLMEngine(str(path), mode="colocated", dtype="float32", max_model_len=128, eos_token_ids=(),
                      kv_cache_memory_bytes=kv_bytes, load_format="dummy" if shape is LARGE else "auto",
                      seed=0, enable_chunked_prefill=False)


def _measure_engine(kind: str, workdir: Path, repeats: int) -> dict:
    """Runs in a child process: generation throughput and weight-sync time of one engine."""
    import torch
    from safetensors.torch import load_file

    from megatron_dapo.rollout import SamplingParams, sync_weights

    out: dict = {"engine": kind, "torch_threads": torch.get_num_threads()}
    start = time.perf_counter()
    engine = _engine(kind, workdir / "tiny", TINY)
    out["start_s"] = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 40, (24,), generator=g)]
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    start = time.perf_counter()
    engine.generate(prompts, 8, params)
    out["first_generate_s"] = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = engine.generate(prompts, 8, params)
        best = min(best, time.perf_counter() - start)
    tokens = sum(len(r.response_ids) for group in result for r in group)
    assert tokens == 24 * 8 * 16, f"{kind}: {tokens} tokens, expected every response to run to max_tokens"
    out.update(generated_tokens=tokens, generate_s=best, tokens_per_s=tokens / best)
    del engine

    engine = _engine(kind, workdir / "large", LARGE)
    weights = load_file(str(workdir / "large" / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    sync_weights(engine, weights.items(), 512 << 20)  # warm-up (first-call allocations)
    start = time.perf_counter()
    sync_weights(engine, weights.items(), 512 << 20)  # buckets, then vLLM's re-processing of layers
    out["sync_s_per_100mb"] = (time.perf_counter() - start) / (nbytes / 100e6)
    copies = {k: t.clone() for k, t in weights.items()}  # touched once: no first-write page faults
    start = time.perf_counter()
    for k, t in weights.items():
        copies[k].copy_(t)
    out["copy_s_per_100mb"] = (time.perf_counter() - start) / (nbytes / 100e6)
    out["sync_bytes"] = nbytes
    return out


def _train(engine: str, run_dir: Path, toy_src: Path | None, steps: int) -> dict:
    if toy_src is not None:  # reuse the toy base: both runs start from the same weights, no warm-up
        for name in ("toy", "toy_data", "toy_base"):
            shutil.copytree(toy_src / name, run_dir / name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny_vllm.yaml"),
           f"logging.dir={run_dir}", f"rollout.engine={engine}", f"train.total_steps={steps}", "eval.every=0",
           "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{engine} run failed:\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > 1]
    mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
    return {"engine": engine, "wall_s": wall, "step_s": mean("timing_s/step"),
            "rollout_s": mean("timing_s/rollout"), "sync_s": mean("timing_s/weight_sync"),
            "mismatch_max": max(abs(r["rollout/logprob_mismatch"] - 1) for r in records if r["step"] > 0)}


QUICK = dict(repeats=1, steps=12, skip_train=True)
FULL = dict(repeats=3, steps=12, skip_train=False)


def measure(repeats: int, steps: int, skip_train: bool, on_engines=None) -> dict:
    """Both engines (each in a fresh process), then the two DAPO runs unless skip_train; on_engines(result)
    is called in between (the CLI prints the engine table before the minutes of training)."""
    result = dict(repeats=repeats, steps=steps, engines={}, runs=None)
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        work = Path(tmp)
        _save_qwen2(work / "tiny", TINY)
        _save_qwen2(work / "large", LARGE)
        for kind in ("hf", "vllm"):
            proc = subprocess.run([sys.executable, __file__, "--child", kind, str(work), "--repeats",
                                   str(repeats)], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            if proc.returncode:
                raise SystemExit(f"{kind} engine failed:\n{proc.stderr[-4000:]}")
            result["engines"][kind] = json.loads(proc.stdout.strip().splitlines()[-1])
        if on_engines:
            on_engines(result)
        if not skip_train:
            result["runs"] = {}
            for kind in ("hf", "vllm"):
                run_dir = work / f"run_{kind}"
                result["runs"][kind] = _train(kind, run_dir, None if kind == "hf" else work / "run_hf", steps)
    return result


def engine_table(result: dict) -> list[str]:
    hf, vl = result["engines"]["hf"], result["engines"]["vllm"]
    lines = [f"generate: {hf['generated_tokens']} tokens (24 prompts x 8 x 16), best of {result['repeats']}",
             "| engine | tokens/s | vs HF | start-up s | first generate s | sync s/100 MB | vs plain copy |",
             "|---|---|---|---|---|---|---|"]
    for e in (hf, vl):
        lines.append(f"| {e['engine']} | {e['tokens_per_s']:.0f} | {e['tokens_per_s'] / hf['tokens_per_s']:.2f}x | "
                     f"{e['start_s']:.1f} | {e['first_generate_s']:.2f} | {e['sync_s_per_100mb']:.3f} | "
                     f"{e['sync_s_per_100mb'] / e['copy_s_per_100mb']:.1f}x |")
    return lines


def train_table(result: dict) -> list[str]:
    runs = result["runs"]
    lines = [f"DAPO step, conf/cpu_tiny_vllm.yaml, torchrun 2 processes, {result['steps']} steps "
             "(means over steps 2..N)",
             "| engine | s/step | vs HF | rollout s | sync s | wall s (start-up included) | max |mismatch-1| |",
             "|---|---|---|---|---|---|---|"]
    for r in (runs["hf"], runs["vllm"]):
        lines.append(f"| {r['engine']} | {r['step_s']:.3f} | {r['step_s'] / runs['hf']['step_s']:.2f}x | "
                     f"{r['rollout_s']:.3f} | {r['sync_s']:.3f} | {r['wall_s']:.0f} | {r['mismatch_max']:.1e} |")
    return lines


def _figure(figure: str, value: float, unit: str, baseline_name: str, baseline: float) -> dict:
    return dict(figure=figure, value=value, unit=unit, baseline_name=baseline_name, baseline=baseline,
                ratio=value / baseline, target=None, met=None)


def figures(result: dict) -> list[dict]:
    """vLLM's generation rate against HF's (ratio > 1: vLLM faster), each engine's weight sync against
    a plain in-memory copy of the same bytes (ratio: how many copies a sync costs), and with training,
    vLLM's DAPO step time against HF's (ratio > 1: vLLM slower). No targets: the HF engine is the
    CPU default, vLLM is here to be measured."""
    hf, vl = result["engines"]["hf"], result["engines"]["vllm"]
    out = [_figure("vLLM generated tokens/s (demo batch, EOS off)", vl["tokens_per_s"], "tokens/s",
                   "HF transformers engine", hf["tokens_per_s"])]
    for e, name in ((vl, "vLLM"), (hf, "HF")):
        out.append(_figure(f"{name} weight sync (230 MB fp32 Qwen2)", e["sync_s_per_100mb"], "s/100 MB",
                           "plain in-memory copy", e["copy_s_per_100mb"]))
    if result["runs"]:
        r = result["runs"]
        out.append(_figure("vLLM DAPO step, cpu_tiny_vllm, torchrun 2 processes", r["vllm"]["step_s"], "s/step",
                           "HF engine", r["hf"]["step_s"]))
    return out


def render_markdown(result: dict) -> str:
    lines = engine_table(result)
    lines += [""] + (train_table(result) if result["runs"] else ["DAPO step: not run (engines only)."])
    return "\n".join(lines) + "\n"


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (engines only, best of 1: ~1-2 min) or FULL (the CLI's
    defaults: best of 3 and 12 DAPO steps per engine, ~4-6 min)."""
    result = measure(**(QUICK if quick else FULL))
    return dict(name="rollout", figures=figures(result), markdown=render_markdown(result), details=result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=FULL["repeats"])
    p.add_argument("--steps", type=int, default=FULL["steps"], help="DAPO steps per training run")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "WORKDIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_measure_engine(args.child[0], Path(args.child[1]), args.repeats)))
        return
    result = measure(args.repeats, args.steps, args.skip_train,
                     on_engines=lambda r: print("\n".join(engine_table(r)), flush=True))
    if result["runs"]:
        print("\n" + "\n".join(train_table(result)))


if __name__ == "__main__":
    main()
