"""The 32B projection of benchmarks/async_rollout.py: the step model (megatron_dapo/step_model.py) at the
32B recipe's plan (conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml, 128 H100s).

Per scenario (a response-length distribution and the generation batches a step needs), the step's
minutes colocated and separate at staleness 0/1/2 and with partial rollouts at staleness 1 (pieces
of at most a quarter of the limit: rollout.partial's default), the GPUs split between the sides at
the best split for each (the trainers in whole TP x PP groups of 16). A partial batch, in steady
state, holds every piece of one batch's worth of responses: each response's first piece and the
later pieces of those begun in earlier batches, which hold their prefix as context and prefill it
again (at the plan's MFU, no prefix cache assumed). Generation per replica: continuous batching over the lengths, at the
plan's decode costs (the weights' read per step, the KV read per token of live context), as many
sequences at once as the KV cache holds (colocated: the plan's share beside the trainer's state;
separate: the recipe's rollout.gpu_memory_utilization of a GPU of its own, the value the engine ranks
are given); training:
the plan's estimate, scaled to the lengths' mean and to the trainers' share of the GPUs; the weights:
the whole bf16 model once over the transfer group. Assumptions are returned with the figures.
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

from megatron_dapo.step_model import (
    StepWork,
    colocated,
    continuous_batching_seconds,
    separate,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml"
WORLD, TRAINER_GROUP = 128, 16  # GPUs; the recipe's TP 8 x PP 2
CAP, LOW = 20480, 64  # response tokens: L_max, and the shortest
SCENARIOS = {  # name -> (lognormal median, sigma, generation batches per step)
    "base": (4000, 0.8, 1),
    "longer tail": (8000, 0.9, 1),
    "2 batches a step": (4000, 0.8, 2),
}
TRANSFER_BYTES_PER_S = 10e9  # trainer rank 0 to the engines: one NIC, well under 400 Gb/s
DECODE_EFFICIENCY = 0.6  # generation_model.DECODE_BANDWIDTH_EFFICIENCY, as the plan uses it
MODES = ("separate k=0", "separate k=1", "separate k=2", "partial k=1")
PREFILL_MFU = 0.3  # the plan's MFU for FLOP-bound work


def pieces(batch: list[int], piece: int) -> tuple[list[int], list[int]]:
    """(the lengths, the prefixes) of every piece of the responses of ``batch``, cut every ``piece`` tokens."""
    cuts = [(min(piece, n - start), start) for n in batch for start in range(0, n, piece)]
    return [c[0] for c in cuts], [c[1] for c in cuts]


def lengths(count: int, median: float, sigma: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(LOW, min(CAP, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def project(steps: int = 4) -> dict:
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.layout import model_shape
    from megatron_dapo.memory_plan import plan

    cfg = load_config(str(RECIPE), [])
    hf, _ = model_shape(cfg.model, "32B")
    p = plan(cfg, hf, WORLD, gpu="h100")
    hbm = p.gpu.hbm_bytes_per_s * DECODE_EFFICIENCY
    costs = dict(weights_step_s=p.rollout.weights / hbm, kv_step_s_per_token=p.rollout.kv_bytes_per_token_per_gpu / hbm,
                 prompt_tokens=cfg.data.max_prompt_length // 2)
    tp = cfg.rollout.tensor_parallel_size
    # An engine on GPUs of its own holds no trainer state: rollout.gpu_memory_utilization of the GPU
    # (the value the engine ranks get), less its weights and profile peak, is KV cache (colocated
    # it gets the plan's share beside the trainer).
    kv_alone = cfg.rollout.gpu_memory_utilization * p.capacity_bytes - p.rollout.weights - p.rollout.activations
    responses = cfg.data.gen_prompts_per_batch * cfg.rollout.n
    plan_tokens = cfg.data.max_prompt_length / 2 + cfg.rollout.max_response_length / 2  # the plan's assumption
    piece = cfg.rollout.max_response_length // 4
    params = p.rollout.weights * tp / 2  # bf16 weights per engine GPU, times rollout TP
    prefill_s_per_token = 2 * params / (tp * p.gpu.bf16_flops * PREFILL_MFU)
    out = {"assumptions": {"world": WORLD, "gpu": "h100", "responses_per_batch": responses,
                           "weights_step_ms": costs["weights_step_s"] * 1e3,
                           "kv_us_per_token": costs["kv_step_s_per_token"] * 1e6,
                           "transfer_GBps": TRANSFER_BYTES_PER_S / 1e9, "plan_step_min": p.step_s / 60,
                           "plan_train_min": (p.step_s - p.generation.seconds) / 60, "piece_tokens": piece,
                           "engine_gpu_memory_utilization": cfg.rollout.gpu_memory_utilization}}
    for name, (median, sigma, per_step) in SCENARIOS.items():
        batches = [[lengths(responses, median, sigma, seed=100 * s + j) for j in range(per_step)] for s in range(steps)]
        flat = [x for step in batches for b in step for x in b]
        mean = statistics.mean(flat)
        per_sequence = costs["prompt_tokens"] + mean  # KV tokens a sequence holds, at this mean
        slots = int(p.rollout.tokens(p.rollout.kv) // per_sequence)
        slots_alone = int(p.rollout.tokens(kv_alone) // per_sequence)
        train = (p.step_s - p.generation.seconds) * (costs["prompt_tokens"] + mean) / plan_tokens

        def gen(b: list[int], gpus: int, n: int, partial: bool = False) -> float:
            replicas = gpus // tp
            lens, prefixes = pieces(b, piece) if partial else (b, [0] * len(b))
            return max(continuous_batching_seconds(lens[i::replicas], prefixes=prefixes[i::replicas], slots=n, **costs)
                       + sum(prefixes[i::replicas]) * prefill_s_per_token for i in range(replicas))

        colo = colocated([StepWork(tuple(gen(b, WORLD, slots) for b in step), 0.0, train) for step in batches])
        row = {"colocated": {"step_min": colo.total_s / steps / 60, "speedup": 1.0, "engines": WORLD,
                             "trainers": WORLD}}
        transfer = p.rollout.weights * tp / TRANSFER_BYTES_PER_S
        generated = {}  # (engine GPUs, partial) -> each step's batches' seconds
        for mode in MODES:
            partial = mode.startswith("partial")
            k = int(mode[-1])
            best = None
            for trainers in range(TRAINER_GROUP, WORLD, TRAINER_GROUP):
                engines = WORLD - trainers
                if (engines, partial) not in generated:
                    generated[engines, partial] = [tuple(gen(b, engines, slots_alone, partial) for b in step)
                                                   for step in batches]
                work = [StepWork(g, 0.0, train * WORLD / trainers + transfer, load=transfer)
                        for g in generated[engines, partial]]
                t = separate(work, max_staleness=k)
                if best is None or t.total_s < best[0].total_s:
                    best = (t, engines, trainers)
            t, engines, trainers = best
            row[mode] = {"step_min": t.total_s / steps / 60, "speedup": colo.total_s / t.total_s, "engines": engines,
                         "trainers": trainers, "engines_idle": t.engines_idle_s / t.total_s,
                         "trainer_waited": t.trainer_waited_s / t.total_s}
        out[name] = {"placements": row, "mean_response": mean, "truncated": sum(x == CAP for x in flat) / len(flat),
                     "slots": slots, "slots_alone": slots_alone, "train_min_128": train / 60, "median": median,
                     "sigma": sigma, "batches_per_step": per_step}
    return out


def markdown(proj: dict) -> str:
    names = list(SCENARIOS)
    lines = ["| placement | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for mode in ("colocated", *MODES):
        cells = []
        for name in names:
            r = proj[name]["placements"][mode]
            split = "" if mode == "colocated" else f", {r['engines']}/{r['trainers']}"
            cells.append(f"{r['step_min']:.1f} min ({r['speedup']:.2f}x{split})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "Scenarios (responses lognormal, cut at 20480): " + "; ".join(
        f"{n}: median {proj[n]['median']}, sigma {proj[n]['sigma']}, mean {proj[n]['mean_response']:.0f} tokens, "
        f"{proj[n]['truncated']:.1%} cut, {proj[n]['slots']} sequences at once per replica colocated and "
        f"{proj[n]['slots_alone']} on engine GPUs of their own, "
        f"{proj[n]['batches_per_step']} generation batch(es) a step" for n in names)
              + ". Splits: engine / trainer GPUs."]
    return "\n".join(lines)
