"""What seeing the policy costs: sample dumps, alarms and the pass-rate ledger, per step.

Measured, at the CPU demo's size (conf/cpu_tiny.yaml): the same run with observability on (the
defaults) and off (``logging.samples_every=0 alarms.enable=false``), interleaved, on one base made
once; the figure is the ratio of the sums of step seconds, and the bytes the dumps wrote per step.

Projected, at the 32B recipe's batch (3 generation batches of 512 prompts x 16 = 24,576 responses of
up to 20k tokens): the work that grows with the batch, timed here on synthetic responses drawn from
a long-tailed length distribution (lognormal, median 4k tokens, cut at 20k, 4 characters a token):
the format audit of every response (a tail scan and one hash of the text), the dump rows (capped:
``logging.samples_per_step`` responses, each cut to ``logging.samples_max_chars``), the alarm dumps
(capped by ``alarms.max_samples``), and the ledger over DAPO-Math-17K's 17,398 prompts. The audit
runs on each replica's leader over its share; the figure is the whole batch on one core (an upper
bound: the recipe has 16 replicas).

    python benchmarks/observe_cost.py [--steps 20 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OFF = ("logging.samples_every=0", "alarms.enable=false")
QUICK, FULL = dict(steps=6, repeats=1, responses=2048), dict(steps=20, repeats=2, responses=24_576)
BATCH_32B, PROMPTS_17K, GROUP_32B = 24_576, 17_398, 16


def _train(run_dir: Path, steps: int, extra: tuple[str, ...]) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
           f"logging.dir={run_dir}", f"train.total_steps={steps}", "eval.every=0", "eval.before_train=false",
           "checkpoint.save_every=0", "logging.progress=false", "logging.tensorboard=false", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env, timeout=1800)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measure_demo(steps: int, repeats: int) -> dict:
    """Sum of step seconds with observability on and off (interleaved), and dump bytes per step."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        _train(base, 1, OFF)  # makes the toy task and its warmed-up base once
        sums = {"on": [], "off": []}
        bytes_per_step = 0.0
        for r in range(repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                run = Path(tmp) / f"{mode}{r}"
                for name in ("toy", "toy_data", "toy_base"):
                    shutil.copytree(base / name, run / name)
                records = _train(run, steps, OFF if mode == "off" else ())
                sums[mode].append(sum(rec["timing_s/step"] for rec in records if rec["step"] > 1))
                if mode == "on":
                    files = list((run / "samples").glob("step_*.jsonl"))
                    bytes_per_step = sum(f.stat().st_size for f in files) / max(1, len(files))
    on, off = min(sums["on"]), min(sums["off"])
    return {"steps": steps, "repeats": repeats, "on_s": on, "off_s": off, "ratio": on / off,
            "dump_bytes_per_step": bytes_per_step}


def _synthetic_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "sum", "of", "squares", "is", "so", "we", "get", "x", "=", "+", "3", "17", "therefore"]
    chunk = " ".join(rng.choice(words) for _ in range(25_000))  # ~100k characters to slice from
    texts = []
    for _ in range(n):
        tokens = min(20_000, int(math.exp(rng.gauss(math.log(4000), 0.8))))
        chars = tokens * 4
        start = rng.randrange(0, max(1, len(chunk) - chars)) if chars < len(chunk) else 0
        body = (chunk * (chars // len(chunk) + 1))[start:start + chars]
        texts.append(body + f"\nAnswer: {rng.randrange(1000)}")
    return texts


def project_32b(num_responses: int) -> dict:
    """The batch-sized work of one 32B step, timed on ``num_responses`` synthetic responses and
    scaled to 24,576 (linear: every piece is per response)."""
    from megatron_dapo.config import DAPOConfig
    from megatron_dapo.observe.audit import audit_group
    from megatron_dapo.observe.ledger import PassRateLedger
    from megatron_dapo.observe.rows import SampleRow, clip_text, write_rows

    cfg = DAPOConfig()
    texts = _synthetic_texts(num_responses)
    acc = [random.Random(1).random() < 0.4 for _ in texts]
    start = time.perf_counter()
    for g in range(0, len(texts), GROUP_32B):
        audit_group(texts[g:g + GROUP_32B], acc[g:g + GROUP_32B], acc[g:g + GROUP_32B])
    audit_s = (time.perf_counter() - start) * BATCH_32B / num_responses
    lg, cap = cfg.logging, cfg.alarms.max_samples
    rows = [SampleRow(phase="train", prompt_index=i, group=i // GROUP_32B, response_index=i % GROUP_32B,
                      prompt=clip_text("p" * 600, lg.samples_max_chars), response=clip_text(t, lg.samples_max_chars),
                      response_tokens=len(t) // 4, response_chars=len(t), finish_reason="stop", ground_truth="7",
                      scorer="dapo_math", acc=True, pred="7")
            for i, t in enumerate(texts[:lg.samples_per_step + 4 * cap])]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        dump = write_rows(Path(tmp) / "step.jsonl", rows[:lg.samples_per_step])
        alarms = write_rows(Path(tmp) / "alarm.jsonl", rows[lg.samples_per_step:]) if cap else 0
        write_s = time.perf_counter() - start
    ledger = PassRateLedger()
    rng = random.Random(2)
    start = time.perf_counter()
    for _ in range(3):  # 3 generation batches of 512 prompts
        ledger.record([rng.randrange(PROMPTS_17K) for _ in range(512)],
                      [[rng.random() < 0.4 for _ in range(GROUP_32B)] for _ in range(512)])
    ledger.metrics()
    ledger_s = time.perf_counter() - start
    for i in range(PROMPTS_17K):  # the end of an epoch: every prompt in the ledger
        ledger.record([i], [[True] * GROUP_32B])
    state_bytes = len(json.dumps(ledger.state()))
    mean_chars = sum(len(t) for t in texts) / len(texts)
    return {"responses_timed": num_responses, "mean_response_chars": mean_chars, "audit_s": audit_s,
            "dump_bytes": dump, "alarm_dump_bytes_max": alarms, "write_s": write_s, "ledger_s": ledger_s,
            "ledger_state_bytes": state_bytes, "gathered_rows_max": lg.samples_per_step + 4 * cap * 3}


def figures(demo: dict, big: dict) -> list[dict]:
    return [
        dict(figure="CPU demo: step seconds, observability on / off", value=demo["on_s"], unit="s",
             baseline_name="observability off", baseline=demo["off_s"], ratio=demo["ratio"], target="<= 1.05",
             met=demo["ratio"] <= 1.05),
        dict(figure="CPU demo: sample dump per step", value=demo["dump_bytes_per_step"] / 1024, unit="KiB",
             baseline_name=None, baseline=None, ratio=None, target=None, met=None),
        dict(figure="32B batch: format audit of 24,576 responses, one core", value=big["audit_s"], unit="s",
             baseline_name=None, baseline=None, ratio=None, target=None, met=None),
        dict(figure="32B batch: dump + alarm dumps per step", value=(big["dump_bytes"] + big["alarm_dump_bytes_max"])
             / (1 << 20), unit="MiB", baseline_name=None, baseline=None, ratio=None, target=None, met=None),
        dict(figure="32B: ledger state at 17,398 prompts", value=big["ledger_state_bytes"] / (1 << 20), unit="MiB",
             baseline_name=None, baseline=None, ratio=None, target=None, met=None),
    ]


def render_markdown(demo: dict, big: dict) -> str:
    return "\n".join([
        "| | value |", "|---|---|",
        f"| CPU demo, sum of step seconds ({demo['steps']} steps, best of {demo['repeats']}) | on {demo['on_s']:.2f} s,"
        f" off {demo['off_s']:.2f} s: {demo['ratio']:.3f}x |",
        f"| CPU demo, dump bytes per step | {demo['dump_bytes_per_step'] / 1024:.1f} KiB |",
        f"| 32B, format audit of 24,576 responses (mean {big['mean_response_chars'] / 1000:.0f}k chars; one core; "
        f"timed on {big['responses_timed']}) | {big['audit_s']:.2f} s |",
        f"| 32B, dump per step (64 responses cut at 8000 chars) | {big['dump_bytes'] / (1 << 20):.2f} MiB |",
        f"| 32B, alarm dumps per step (at most) | {big['alarm_dump_bytes_max'] / (1 << 20):.2f} MiB |",
        f"| 32B, writing both | {big['write_s'] * 1000:.0f} ms |",
        f"| 32B, ledger update of a step (3 x 512 groups) | {big['ledger_s'] * 1000:.0f} ms |",
        f"| 32B, ledger in trainer_state.json (17,398 prompts) | {big['ledger_state_bytes'] / (1 << 20):.2f} MiB |",
        f"| 32B, rows gathered to every rank per step (at most) | {big['gathered_rows_max']} |"])


def run(quick: bool) -> dict:
    size = QUICK if quick else FULL
    demo, big = measure_demo(size["steps"], size["repeats"]), project_32b(size["responses"])
    return dict(name="observe_cost", figures=figures(demo, big), markdown=render_markdown(demo, big),
                details={"demo": demo, "projection_32b": big})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=FULL["steps"])
    p.add_argument("--repeats", type=int, default=FULL["repeats"])
    p.add_argument("--responses", type=int, default=FULL["responses"], help="synthetic responses timed (32B part)")
    args = p.parse_args()
    demo, big = measure_demo(args.steps, args.repeats), project_32b(args.responses)
    print(render_markdown(demo, big))
    return 0


if __name__ == "__main__":
    sys.exit(main())
