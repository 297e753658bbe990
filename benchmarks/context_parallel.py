"""Context parallelism on CPU: one DAPO step's trainer work on long sequences at CP 2 (two processes,
each holding half of every sequence's positions) against CP 1 (one process), the same cores in all.

The batch: ``samples`` sequences of ``prompt + response`` tokens, one sequence a micro-batch (the
token budget is one sequence, as the 32k recipe sets it). Each side runs under torchrun in processes
of its own (MegatronActor, local spec, fp32, the same weights from the same seed): the forward-only
log-prob pass, then one update over the batch. CP 1 runs one process with ``2 x threads`` threads, CP 2
two processes of ``threads`` each. Memory: each rank's peak RSS during the step above its RSS before
it (benchmarks/_rss.py), the larger rank's; the activations a rank keeps are what CP divides. Both
sides must report the same loss and grad norm (fp32 round-off). Time: the best of ``--rounds``
alternating runs.

    python benchmarks/context_parallel.py            # ~2 min on 2 cores
    python benchmarks/context_parallel.py --quick    # < 1 min
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emit import emit  # noqa: E402  (benchmarks/ on the path first)
ROOT = Path(__file__).resolve().parents[1]

FULL = dict(prompt=256, response=3840, samples=4, layers=4, hidden=256, vocab=4096)
QUICK = dict(prompt=64, response=960, samples=2, layers=2, hidden=128, vocab=2048)


def child(case: dict, out: str) -> None:
    """One side's step on this rank (torchrun's RANK / WORLD_SIZE); writes its figures to ``out``.<rank>."""
    import dataclasses

    import torch

    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from _rss import reset_peak, rss_mb

    from megatron_dapo.batching import Sample
    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, ParallelConfig, RewardConfig,
        RolloutConfig, TrainConfig,
    )
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    seq = case["prompt"] + case["response"]
    hf = dict(model_type="qwen2", vocab_size=case["vocab"], hidden_size=case["hidden"],
              intermediate_size=3 * case["hidden"], num_hidden_layers=case["layers"],
              num_attention_heads=case["hidden"] // 32, num_key_value_heads=case["hidden"] // 64, rms_norm_eps=1e-6,
              rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
              max_position_embeddings=seq, hidden_act="silu", initializer_range=0.02)
    n = case["samples"]
    cfg = DAPOConfig(seed=1, model=ModelConfig(make_vocab_size_divisible_by=64),
                     parallel=ParallelConfig(context_parallel_size=world),
                     data=DataConfig(prompts_per_step=n // 2, gen_prompts_per_batch=n // 2,
                                     max_prompt_length=case["prompt"]),
                     rollout=RolloutConfig(n=2, max_response_length=case["response"]),
                     reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=case["response"] // 5)),
                     train=TrainConfig(mini_batch_prompts=n // 2, max_tokens_per_micro_batch=seq),
                     optim=OptimConfig(lr=1e-6, lr_warmup_steps=0))
    actor = MegatronActor(cfg, hf)
    g = torch.Generator().manual_seed(2)
    xs = [Sample(prompt_ids=torch.randint(0, case["vocab"], (case["prompt"],), generator=g),
                 response_ids=torch.randint(0, case["vocab"], (case["response"],), generator=g),
                 advantages=float(torch.randn((), generator=g))) for _ in range(n)]
    actor.prepare_for_training()
    actor.get_inference_log_probs(xs[:1])  # warm-up (allocator, kernels)
    before = rss_mb()
    reset_peak()
    start = time.perf_counter()
    lps = actor.get_inference_log_probs(xs)
    logprob_s = time.perf_counter() - start
    xs = [dataclasses.replace(x, old_log_probs=lp + 0.05) for x, lp in zip(xs, lps)]
    start = time.perf_counter()
    m = actor.get_loss_and_metrics(xs)
    update_s = time.perf_counter() - start
    Path(f"{out}.{rank}").write_text(json.dumps(dict(
        logprob_s=logprob_s, update_s=update_s, peak_mb=rss_mb("VmHWM") - before, loss=m["actor/pg_loss"],
        grad_norm=m["actor/grad_norm"], tokens=m["actor/num_tokens"])))
    destroy_parallel()


def _side(case: dict, cp: int, threads: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
           "--child", json.dumps(case), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"CP {cp} failed:\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]
    return dict(ranks[0], peak_mb=max(r["peak_mb"] for r in ranks), step_s=max(r["logprob_s"] + r["update_s"]
                                                                              for r in ranks))


def measure(quick: bool, rounds: int, threads: int) -> dict:
    case = QUICK if quick else FULL
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as tmp:
        for i in range(rounds):
            for cp in (1, 2):
                runs[cp].append(_side(case, cp, threads * (2 // cp), Path(tmp) / f"cp{cp}_{i}"))
    best = {cp: min(rs, key=lambda r: r["step_s"]) for cp, rs in runs.items()}
    for cp in best:
        best[cp]["peak_mb"] = max(r["peak_mb"] for r in runs[cp])
    one, two = best[1], best[2]
    for key in ("loss", "grad_norm"):
        if abs(two[key] - one[key]) > 1e-4 * max(abs(one[key]), 1e-3):
            raise AssertionError(f"{key} differs: CP 1 {one[key]}, CP 2 {two[key]}")
    return dict(case=case, threads_per_rank={1: 2 * threads, 2: threads}, cp1=one, cp2=two,
                peak_cp2_over_cp1=two["peak_mb"] / one["peak_mb"], time_cp2_over_cp1=two["step_s"] / one["step_s"],
                date=time.strftime("%Y-%m-%d"))


def run(quick: bool) -> dict:
    """run_all.py's entry: the per-rank peak memory and step time of CP 2 against CP 1 (no target)."""
    r = measure(quick, rounds=1 if quick else 2, threads=1)
    figures = [dict(figure="a rank's peak memory over one step's trainer work, CP 2", value=r["cp2"]["peak_mb"],
                    unit="MB", baseline_name="CP 1", baseline=r["cp1"]["peak_mb"], ratio=r["peak_cp2_over_cp1"],
                    target=None, met=None),
               dict(figure="one step's trainer work, CP 2 (two processes)", value=r["cp2"]["step_s"], unit="s",
                    baseline_name="CP 1 (one process, as many threads)", baseline=r["cp1"]["step_s"],
                    ratio=r["time_cp2_over_cp1"], target=None, met=None)]
    rows = ["| layout | step s | peak MB per rank | loss | grad norm |", "|---|---|---|---|---|"]
    rows += [f"| CP {cp} | {r[f'cp{cp}']['step_s']:.2f} | {r[f'cp{cp}']['peak_mb']:.0f} | {r[f'cp{cp}']['loss']:.6f} "
             f"| {r[f'cp{cp}']['grad_norm']:.6f} |" for cp in (1, 2)]
    return dict(name="context_parallel", figures=figures, markdown="\n".join(rows), details=r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 1 min)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side; the best counts")
    parser.add_argument("--threads", type=int, default=1, help="threads per CP 2 rank (CP 1 gets twice as many)")
    parser.add_argument("--out", help="also write the result as JSON here (e.g. docs/context_parallel.json)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child[0]), args.child[1])
        return 0
    return emit(measure(args.quick, args.rounds, args.threads), args.out)


if __name__ == "__main__":
    sys.exit(main())
