"""Rollout routing replay (R3) in miniature, on a CPU: the engine/trainer mismatch of a tiny Qwen3-MoE with
the trainer routing tokens itself against replaying the engine's routes, in two settings.

Table 1's task and DAPO row (benchmarks/losses.py) on a tiny Qwen3-MoE (2 layers, 8 experts of width 64,
top-2, every layer MoE), pi_old the trainer's, token TIS at 2.0 (the correction sees the mismatch):
  bf16 engine   synchronous, one process; the HF engine computes in bf16 (rollout.dtype=bf16) beside the
                fp32 trainer, from the same weights: the mismatch R3 is meant for, routers that flip on
                numerics alone (on GPU: vLLM's kernels against Megatron's);
  stale         benchmarks/rollout_corrections.py's off-policy setting: separate placement at staleness 1
                with partial rollouts (torchrun, 2 processes), fp32 on both sides: the engine's weights
                are one or two updates old, so its routes are an older policy's.
Without R3 the trainer's pi_old routes every token itself; with R3 (moe.router_replay=R3) it routes each
token to the experts the engine chose for it.

And at the same weights, with no training in between (``same_weights``): a bf16 HF engine generates from
a seed's toy base and returns its routes; the fp32 trainer computes the log-probs of the same responses
replaying them (R3) and replaying the fp32 model's own routes (= routing itself, without R3); both against
the engine's log-probs. This isolates R3's one effect, which the training runs above mix with how their
policies drift apart.

    python benchmarks/moe_r3.py                    # 2 settings x 2 rows x 3 seeds, and same_weights
    python benchmarks/moe_r3.py --seeds 1 --budget 1024   # a quick look

Per row, mean over seeds: the mismatch KL of the rollout policy from pi_old (rollout_corr/kl), the token
chi-square, the fraction of tokens TIS truncates, moe/route_agreement (R3: how often the trainer's own
router would have chosen the replayed experts), the final held-out avg@k and entropy. Writes
<out>/moe_r3.json and <out>/moe_r3.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import table1  # noqa: E402  the task, one run and its summary
from losses import DAPO_ROW  # noqa: E402
from rollout_corrections import ASYNC  # noqa: E402

MOE_TOY = ["toy.architecture=qwen3_moe", "toy.num_experts=8", "toy.num_experts_per_tok=2",
           "toy.moe_intermediate_size=64"]
CORRECTION = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
SETTINGS = [("bf16 engine", ["rollout.dtype=bf16", "train.old_log_probs=trainer"], 1), ("stale", ASYNC, 2)]
ROWS = [("trainer routes", []), ("R3", ["moe.router_replay=R3"])]
PER_STEP = {
    "kl": "rollout_corr/kl",
    "chi2": "rollout_corr/chi2_token",
    "truncated": "rollout_corr/is_frac_high",
    "agreement": "moe/route_agreement",
    "lag": "rollout/version_lag_mean",
}


def _make_toy(seed: int, out: Path) -> Path:
    """The seed's MoE toy data and base, made once and copied into each row's run dir (table1._run)."""
    return table1._make_toy(seed, out, tuple(MOE_TOY), name="toy_moe")


def _per_step(run_dir: Path) -> dict[str, float | None]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "rollout_corr/kl" in r]
    return {key: statistics.fmean(r[name] for r in steps) if name in steps[0] else None
            for key, name in PER_STEP.items()}


def measure(seeds: int, budget: int, out: Path) -> dict:
    start = time.perf_counter()
    results = []
    for seed in range(1, seeds + 1):
        prep = _make_toy(seed, out)
        for setting, context, nproc in SETTINGS:
            for name, row in ROWS:
                label = f"{setting}, {name}"
                print(f"moe_r3: {label}, seed {seed} ...", flush=True)
                r = table1._run(label, [*DAPO_ROW, *MOE_TOY, *context, *CORRECTION, *row], seed, budget, out, prep,
                                nproc=nproc)
                r.update(_per_step(out / "runs" / f"{table1._slug(label)}_seed{seed}"), setting=setting)
                results.append(r)
    return {"budget": budget, "wall_s": time.perf_counter() - start, "runs": results}


def markdown(result: dict) -> str:
    runs, k = result["runs"], result["runs"][0]["k"]
    lines = [f"| setting | trainer's routing | mismatch KL | token chi² | tokens truncated | route agreement | "
             f"held-out avg@{k} | final entropy | version lag | steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (setting, _, _), (name, _) in ((s, r) for s in SETTINGS for r in ROWS):
        rs = [r for r in runs if r["row"] == f"{setting}, {name}"]

        def col(key):
            values = [r[key] for r in rs]
            return "n/a" if None in values else _mean_sd(values)

        lines.append(f"| {setting} | {name} | {col('kl')} | {col('chi2')} | {col('truncated')} | {col('agreement')} | "
                     f"{col('avg_at_k')} | {col('entropy')} | {col('lag')} | "
                     f"{statistics.fmean(r['steps'] for r in rs):.0f} |")
    seeds = sorted({r["seed"] for r in runs})
    lines.append(f"\nMean ± sample standard deviation over seeds {seeds}; per-step columns averaged over each "
                 f"run's steps; every run stopped after {result['budget']} generated responses; "
                 f"{sum(r['wall_s'] for r in runs) / 60:.1f} min of runs (one at a time).")
    return "\n".join(lines)


def _mean_sd(values: list[float]) -> str:
    """Mean ± sample standard deviation, 3 significant digits (the bf16 rows' figures are ~1e-4)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3g} ± {sd:.2g}"


def same_weights(prep: Path, *, prompts: int = 64, n: int = 8, seed: int = 1) -> dict:
    """R3 against routing itself at the same weights (module docstring), in this process (a world of one)."""
    import os
    import random
    import socket

    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.batching import Sample
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.groups import routes_of
    from megatron_dapo.convert.safetensors_io import read_hf_config
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
    from megatron_dapo.mcore.parallel import shutdown_distributed
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.hf_engine import HFEngine, RouteRecorder
    from megatron_dapo.toy import task as toy_task
    from megatron_dapo.toy.base import batch_prompt_ids, stop_token_ids

    apply_cpu_compat()
    hf_dir = prep / "toy_base"
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    rng = random.Random(f"moe-r3-{seed}")
    questions = [toy_task.format_question(toy_task.sample_problem(rng, 12, 4)[0]) for _ in range(prompts)]
    engine = HFEngine.from_pretrained(str(hf_dir), dtype=torch.bfloat16, eos_token_ids=stop_token_ids(tokenizer),
                                      return_routed_experts=True)
    rollouts = [r for group in engine.generate(batch_prompt_ids(tokenizer, questions), n,
                                               SamplingParams(max_tokens=14, seed=seed)) for r in group]
    fp32 = HFEngine.from_pretrained(str(hf_dir), dtype=torch.float32)
    recorder = RouteRecorder(fp32.model)

    def own_routes(r) -> torch.Tensor:  # the fp32 model's, i.e. the trainer's, routing of what the engine fed
        with torch.no_grad():
            fp32.model(input_ids=torch.tensor([r.prompt_ids + r.response_ids[:-1]]))
        return recorder.take(1)[0].flatten(1)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    cfg = load_config(table1.ROOT / "conf" / "cpu_tiny_moe.yaml",
                      ["toy.enable=false", f"model.hf_path={hf_dir}", "parallel.expert_model_parallel_size=1",
                       "moe.router_replay=R3", "rollout.temperature=1.0", f"logging.dir={prep / 'same_weights'}"])
    actor = MegatronActor(cfg, read_hf_config(hf_dir))
    actor.load_hf_weights(str(hf_dir))
    engine_routes = [routes_of(r) for r in rollouts]
    trainer_routes = [own_routes(r) for r in rollouts]

    def samples(routes):
        return [Sample(prompt_ids=torch.tensor(r.prompt_ids), response_ids=torch.tensor(r.response_ids),
                       routed_experts=route) for r, route in zip(rollouts, routes)]

    engine_lp = torch.cat([torch.tensor(r.logprobs) for r in rollouts])
    replayed = torch.cat(actor.get_inference_log_probs(samples(engine_routes)))
    itself = torch.cat(actor.get_inference_log_probs(samples(trainer_routes)))
    shutdown_distributed()
    k = cfg.toy.num_experts_per_tok
    same = [(a.view(len(a), -1, k).sort(-1).values == b.view(len(b), -1, k).sort(-1).values).all(-1)
            for a, b in zip(engine_routes, trainer_routes)]
    # response tokens predicted at a position whose routes differ in some layer (token j at P - 1 + j)
    flipped = torch.cat([~x.all(-1)[len(r.prompt_ids) - 1:] for x, r in zip(same, rollouts)])
    return {"responses": len(rollouts), "tokens": int(engine_lp.numel()), "flipped_tokens": int(flipped.sum()),
            "route_agreement": float(torch.cat([x.flatten() for x in same]).float().mean()),
            "abs_diff_mean_flipped": {"trainer routes": float((itself - engine_lp)[flipped].abs().mean()),
                                      "R3": float((replayed - engine_lp)[flipped].abs().mean())},
            "abs_diff_mean": {"trainer routes": float((itself - engine_lp).abs().mean()),
                              "R3": float((replayed - engine_lp).abs().mean())},
            "abs_diff_max": {"trainer routes": float((itself - engine_lp).abs().max()),
                             "R3": float((replayed - engine_lp).abs().max())},
            "kl_k3": {name: float((torch.expm1(d) - d).mean()) for name, d in
                      (("trainer routes", itself - engine_lp), ("R3", replayed - engine_lp))}}


def same_weights_markdown(rows: list[dict]) -> str:
    lines = ["| trainer's routing | mean abs(log p_trainer - log p_engine) | the same on tokens whose routes flipped | "
             "max | k3 KL |", "|---|---|---|---|---|"]
    for name in ("trainer routes", "R3"):
        lines.append(f"| {name} | {_mean_sd([r['abs_diff_mean'][name] for r in rows])} | "
                     f"{_mean_sd([r['abs_diff_mean_flipped'][name] for r in rows])} | "
                     f"{_mean_sd([r['abs_diff_max'][name] for r in rows])} | "
                     f"{_mean_sd([r['kl_k3'][name] for r in rows])} |")
    agree = _mean_sd([r["route_agreement"] for r in rows])
    lines.append(f"\nbf16 engine, fp32 trainer, the same weights (each seed's toy base); {rows[0]['responses']} "
                 f"responses ({rows[0]['tokens']} tokens) a seed, seeds 1-{len(rows)}; the engine's routes agree "
                 f"with the trainer's own on {agree} of the (token, layer) pairs; tokens predicted at a position "
                 f"where some layer's routes flipped: {[r['flipped_tokens'] for r in rows]}.")
    return "\n".join(lines)


def figures(result: dict) -> list[dict]:
    """R3's figures against routing itself, measured in the same run: at the same weights the mismatch on the
    tokens whose routes flipped and the k3 KL over all; in training with a bf16 engine and with stale
    rollouts, the mismatch KL per step. No targets: docs/moe.md reads them."""
    out = []
    rows = result["same_weights"]
    for key, label in (("abs_diff_mean_flipped", "mean |log p diff| on tokens whose routes flipped"),
                       ("kl_k3", "k3 KL over all tokens")):
        base, r3 = (statistics.fmean(r[key][name] for r in rows) for name in ("trainer routes", "R3"))
        out.append(dict(figure=f"same weights, bf16 engine: {label}, R3", value=r3, unit="nats",
                        baseline_name="trainer routes", baseline=base, ratio=r3 / base, target=None, met=None))
    for setting, _, _ in SETTINGS:
        base, r3 = (statistics.fmean(r["kl"] for r in result["runs"] if r["row"] == f"{setting}, {name}")
                    for name in ("trainer routes", "R3"))
        out.append(dict(figure=f"{setting}: per-step mismatch KL, R3", value=r3, unit="nats",
                        baseline_name="trainer routes", baseline=base, ratio=r3 / base if base else None,
                        target=None, met=None))
    return out


# Quick: one seed, 640 responses a run; full: the CLI's defaults.
QUICK = dict(seeds=1, budget=640)
FULL = dict(seeds=3, budget=4096)


def _measure_all(seeds: int, budget: int, out: Path) -> dict:
    result = measure(seeds, budget, out)
    result["same_weights"] = [same_weights(_make_toy(seed, out), seed=seed) for seed in range(1, seeds + 1)]
    return result


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry, in a temporary directory: QUICK or FULL (see above)."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_moe_r3_") as tmp:
        result = _measure_all(size["seeds"], size["budget"], Path(tmp))
    runs = [{k: v for k, v in r.items() if k not in ("curve", "entropy_curve")} for r in result["runs"]]
    return dict(name="moe_r3", figures=figures(result),
                markdown=markdown(result) + "\n\n" + same_weights_markdown(result["same_weights"]),
                details=dict(result, runs=runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=FULL["seeds"], help="seeds 1..N per row")
    p.add_argument("--budget", type=int, default=FULL["budget"], help="generated responses per run")
    p.add_argument("--out", default=None, help="output dir (finished runs are reused); default: a temporary one")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_moe_r3_") as tmp:
        out = Path(args.out).resolve() if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        result = _measure_all(args.seeds, args.budget, out)
        text = markdown(result) + "\n\n" + same_weights_markdown(result["same_weights"])
        (out / "moe_r3.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "moe_r3.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
