"""Packed against padded micro-batches (train.pack_sequences): one DAPO step's trainer work on a
mixed-length batch with a long tail to the cap, on CPU, and the same batch modelled at the 32B
recipe's sizes.

The batch. DAPO's responses are long-tailed: most end well before the cap, a few percent run into
it (the overlong buffer then shapes their reward), and the mean grows during training. Lengths
here: a log-normal with its median at ``MEDIAN`` of the cap and sigma ``SIGMA``, every draw past
the cap truncated to it (~4% at these values); prompts uniform in [P/4, P]. The token budget per
micro-batch is one sequence of the longest prompt and response, as the recipes set it
(train.max_tokens_per_micro_batch 22528 = 2048 + 20480): a padded micro-batch holds as many rows
as fit under it at its longest sample's length, a packed one as many samples as fit end to end.

One step's trainer work, on each side in a process of its own (MegatronActor in a world of one,
local spec, fp32): the forward-only log-prob pass over the whole batch (pi_old,
train.old_log_probs=trainer), then the batch's updates (mini-batches of ``--mini`` samples). Both
sides start from the same weights and must report the same first loss (fp32 round-off). Time: the
best of ``--rounds`` alternating runs; tokens/s counts the samples' tokens, not the padding. Memory:
peak RSS during the step above the RSS before it (benchmarks/_rss.py).

The 32B model: the same length distribution at the recipe's sizes (responses to 20480, prompts
to 2048, 512 responses per step, budget 22528) planned both ways without running a model:
computed tokens and attended pairs (causal: L(L+1)/2 per sample packed; rows x s(s+1)/2 padded)
-> FLOPs of Qwen2.5-32B's update and log-prob pass, against the planner's, which counts the
samples' tokens alone (memory_plan.plan).

    python benchmarks/packing.py                 # ~5 min on 2 cores
    python benchmarks/packing.py --quick         # < 1 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emit import emit  # noqa: E402  (benchmarks/ on the path first)
ROOT = Path(__file__).resolve().parents[1]

MEDIAN, SIGMA = 0.18, 0.9  # of the cap; log-normal, truncated at the cap
FULL = dict(cap=1024, prompt=128, samples=128, mini=32, layers=4, hidden=256, vocab=8192)
QUICK = dict(cap=256, prompt=32, samples=32, mini=16, layers=2, hidden=128, vocab=2048)
# padded: rows under the budget at their longest (first-fit decreasing); _uniform: every micro-batch one
# shape, [budget // longest, longest] padded or [1, budget] packed (pipelines that cannot exchange
# shapes, EP's allgather dispatcher: micro_batches.batching_kwargs)
LAYOUTS = ("padded", "packed", "padded_uniform", "packed_uniform")
RECIPE_32B = dict(cap=20480, prompt=2048, samples=512, budget=22528, params=32.5e9, layers=64, hidden=5120)


def draw_lengths(samples: int, cap: int, prompt: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) tokens per sample: responses log-normal (median MEDIAN x cap, SIGMA),
    truncated at ``cap``; prompts uniform in [prompt / 4, prompt]."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        response = min(cap, max(1, round(math.exp(rng.gauss(math.log(MEDIAN * cap), SIGMA)))))
        out.append((rng.randint(max(1, prompt // 4), prompt), response))
    return out


def layout_cost(lengths: list[int], budget: int, layout: str) -> dict:
    """Micro-batches, computed tokens and causally attended pairs of one layout (no model)."""
    from megatron_dapo.batching import plan_micro_batches, plan_packs, uniform_shape

    packed, uniform = layout.startswith("packed"), layout.endswith("uniform")
    shape = uniform_shape(max(lengths), max_tokens=budget, micro_batch_size=1, packed=packed) if uniform else None
    if packed:
        plan = plan_packs(lengths, max_tokens=shape[1] if shape else budget, micro_batch_size=1)
    else:
        plan = plan_micro_batches(lengths, max_tokens=0 if shape else budget, micro_batch_size=shape[0] if shape else 1)
    tokens = pairs = 0
    for group in plan:
        ls = [lengths[i] for i in group]
        rows, width = (1, sum(ls)) if packed else (len(ls), max(ls))
        if shape:
            rows, width = shape
        tokens += rows * width
        if packed:  # each sample attends within itself; the pack's padding is a segment of its own
            pairs += sum(n * (n + 1) // 2 for n in ls) + (width - sum(ls)) * (width - sum(ls) + 1) // 2
        else:
            pairs += rows * width * (width + 1) // 2
    return dict(micro_batches=len(plan), computed_tokens=tokens, attended_pairs=pairs)


def model_32b() -> dict:
    """The recipe-sized batch planned both ways; FLOPs of one step's trainer work (log-prob pass,
    forward + backward of the update: 2 + 6 per parameter and token; attention 4 x hidden per
    attended pair and layer, x 4 for the pass and the update)."""
    r = RECIPE_32B
    shapes = draw_lengths(r["samples"], r["cap"], r["prompt"], seed=1)
    lengths = [p + q for p, q in shapes]
    real = sum(lengths)
    out = {"samples": r["samples"], "real_tokens": real, "mean_response": sum(q for _, q in shapes) / len(shapes),
           "at_cap": sum(q == r["cap"] for _, q in shapes) / len(shapes)}
    for name in LAYOUTS:
        cost = layout_cost(lengths, r["budget"], name)
        linear = 8 * r["params"] * cost["computed_tokens"]
        attention = 4 * 4 * r["layers"] * r["hidden"] * cost["attended_pairs"]
        out[name] = {**cost, "flops": linear + attention, "padding_fraction": 1 - real / cost["computed_tokens"]}
    out["planner_flops"] = 8 * r["params"] * real  # memory_plan.plan's count: the samples' tokens alone
    out["flops_padded_over_packed"] = out["padded"]["flops"] / out["packed"]["flops"]
    out["flops_padded_uniform_over_packed_uniform"] = out["padded_uniform"]["flops"] / out["packed_uniform"]["flops"]
    return out


def child(layout: str, case: dict, out: str) -> None:
    """One step's trainer work on one layout; writes its measurements to ``out`` as JSON."""
    os.environ.pop("RANK", None)
    import dataclasses

    import torch

    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from _rss import reset_peak, rss_mb

    from megatron_dapo.batching import Sample, count_micro_batches, make_micro_batches
    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, RewardConfig, RolloutConfig,
        TrainConfig,
    )
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.train_step import compute_log_probs

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    hf = dict(model_type="qwen2", vocab_size=case["vocab"], hidden_size=case["hidden"],
              intermediate_size=3 * case["hidden"], num_hidden_layers=case["layers"],
              num_attention_heads=case["hidden"] // 32, num_key_value_heads=case["hidden"] // 64, rms_norm_eps=1e-6,
              rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
              max_position_embeddings=case["cap"] + case["prompt"], hidden_act="silu", initializer_range=0.02)
    budget = case["cap"] + case["prompt"]
    packed, uniform = layout.startswith("packed"), layout.endswith("uniform")
    cfg = DAPOConfig(seed=1, model=ModelConfig(make_vocab_size_divisible_by=64),
                     data=DataConfig(prompts_per_step=case["samples"] // 2, gen_prompts_per_batch=case["samples"] // 2,
                                     max_prompt_length=case["prompt"]),
                     rollout=RolloutConfig(n=2, max_response_length=case["cap"]),  # the scheduler's update count
                     reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=case["cap"] // 5)),
                     train=TrainConfig(mini_batch_prompts=case["mini"] // 2, max_tokens_per_micro_batch=budget,
                                       pack_sequences=packed),
                     optim=OptimConfig(lr=1e-6, lr_warmup_steps=0))
    if uniform:  # the batching of a pipeline that cannot exchange shapes, or of EP's allgather dispatcher
        from megatron_dapo.mcore import micro_batches

        layout_kwargs = micro_batches.batching_kwargs
        micro_batches.batching_kwargs = lambda model, settings: {**layout_kwargs(model, settings), "uniform": True}
    actor = MegatronActor(cfg, hf)
    g = torch.Generator().manual_seed(2)
    xs = [Sample(prompt_ids=torch.randint(0, case["vocab"], (p,), generator=g),
                 response_ids=torch.randint(0, case["vocab"], (r,), generator=g),
                 advantages=float(torch.randn((), generator=g))) for p, r in case["shapes"]]
    kw = dict(max_tokens=budget, micro_batch_size=1, packed=packed, uniform=uniform)
    computed = sum(mb.num_padded_tokens for mb in make_micro_batches(xs, **kw))
    actor.prepare_for_training()
    lps, _ = compute_log_probs(actor.model, xs, actor.settings)  # warm-up (allocator, kernels)
    before = rss_mb()
    reset_peak()
    start = time.perf_counter()
    lps, _ = compute_log_probs(actor.model, xs, actor.settings)
    logprob_s = time.perf_counter() - start
    xs = [dataclasses.replace(x, old_log_probs=lp) for x, lp in zip(xs, lps)]
    losses = []
    start = time.perf_counter()
    for k in range(0, len(xs), case["mini"]):
        m = actor.get_loss_and_metrics(xs[k:k + case["mini"]])
        losses.append(m["actor/pg_loss"])
    update_s = time.perf_counter() - start
    peak = rss_mb("VmHWM") - before
    Path(out).write_text(json.dumps(dict(
        layout=layout, logprob_s=logprob_s, update_s=update_s, peak_mb=peak, losses=losses, computed_tokens=computed,
        micro_batches=count_micro_batches(xs, **kw), real_tokens=sum(p + r for p, r in case["shapes"]))))
    destroy_parallel()


def measure(case: dict, rounds: int) -> dict:
    import tempfile

    runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "2")}
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        for i in range(rounds):
            for layout in LAYOUTS:
                out = Path(tmp) / f"{layout}{i}.json"
                proc = subprocess.run([sys.executable, __file__, "--child", layout, json.dumps(case), str(out)],
                                      cwd=ROOT, env=env, capture_output=True, text=True, check=False)
                if proc.returncode:
                    raise RuntimeError(f"{layout} failed:\n{proc.stderr[-4000:]}")
                runs[layout].append(json.loads(out.read_text()))
    result = {}
    for layout, rs in runs.items():
        best = min(rs, key=lambda r: r["logprob_s"] + r["update_s"])
        step = best["logprob_s"] + best["update_s"]
        result[layout] = {**{k: best[k] for k in ("micro_batches", "computed_tokens", "real_tokens", "losses")},
                          "logprob_s": best["logprob_s"], "update_s": best["update_s"], "step_s": step,
                          "tokens_per_s": best["real_tokens"] / step,
                          "peak_mb": max(r["peak_mb"] for r in rs),
                          "padding_fraction": 1 - best["real_tokens"] / best["computed_tokens"]}
    first = result["padded"]["losses"][0]
    for layout in LAYOUTS[1:]:
        got = result[layout]["losses"][0]
        if abs(got - first) > 1e-4 * max(abs(first), 1e-3):
            raise AssertionError(f"the first update's loss differs: padded {first}, {layout} {got}")
    result["first_loss_equal"] = True
    for base, other in (("padded", "packed"), ("padded_uniform", "packed_uniform")):
        result[f"{other}_over_{base}"] = {
            "tokens_per_s": result[other]["tokens_per_s"] / result[base]["tokens_per_s"],
            "peak": result[other]["peak_mb"] / result[base]["peak_mb"]}
    return result


def measure_all(quick: bool, rounds: int) -> dict:
    case = dict(QUICK if quick else FULL)
    case["shapes"] = draw_lengths(case["samples"], case["cap"], case["prompt"])
    responses = [r for _, r in case["shapes"]]
    return {"case": {k: v for k, v in case.items() if k != "shapes"},
            "responses": {"mean": sum(responses) / len(responses), "max": max(responses),
                          "at_cap": sum(r == case["cap"] for r in responses) / len(responses)},
            "cpu": measure(case, rounds), "model_32b": model_32b(),
            "date": time.strftime("%Y-%m-%d"), "threads": int(os.environ.get("BENCH_THREADS", "2"))}


def run(quick: bool) -> dict:
    """run_all.py's entry: the packed / padded tokens/s ratios (no target: docs/packing.md says why
    the first is ~1) and the 32B model's FLOPs ratios."""
    result = measure_all(quick, rounds=1 if quick else 2)
    cpu, m = result["cpu"], result["model_32b"]
    figures = [dict(figure=f"one step's trainer work, packed{suffix}", value=cpu[f"packed{suffix}"]["tokens_per_s"],
                    unit="tokens/s", baseline_name=f"padded{suffix}", baseline=cpu[f"padded{suffix}"]["tokens_per_s"],
                    ratio=cpu[f"packed{suffix}_over_padded{suffix}"]["tokens_per_s"], target=None, met=None)
               for suffix in ("", "_uniform")]
    figures += [dict(figure=f"32B step's trainer FLOPs, padded{suffix} (modelled)", value=m[f"padded{suffix}"]["flops"],
                     unit="FLOP", baseline_name=f"packed{suffix}", baseline=m[f"packed{suffix}"]["flops"],
                     ratio=m[f"padded{suffix}"]["flops"] / m[f"packed{suffix}"]["flops"], target=None, met=None)
                for suffix in ("", "_uniform")]
    rows = ["| layout | micro-batches | padding | step s | tokens/s | peak MB |", "|---|---|---|---|---|---|"]
    rows += [f"| {k} | {cpu[k]['micro_batches']} | {cpu[k]['padding_fraction']:.1%} | {cpu[k]['step_s']:.2f} | "
             f"{cpu[k]['tokens_per_s']:.0f} | {cpu[k]['peak_mb']:.0f} |" for k in LAYOUTS]
    return dict(name="packing", figures=figures, markdown="\n".join(rows), details=result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 1 min)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per layout; the best counts")
    parser.add_argument("--out", help="also write the result as JSON here (e.g. docs/packing.json)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], json.loads(args.child[1]), args.child[2])
        return 0
    return emit(measure_all(args.quick, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
