"""What progress inside a step costs the engine's decode loop (observe/step_progress.py).

The HF engine's generation of one batch, timed three ways, interleaved, on one random tiny Qwen2
(2 layers, hidden 32: a decode step of ~1 ms, where a fixed cost per token step weighs the most; a
32B decode step takes tens of ms): no progress (``on_progress`` None, the baseline), progress that
is never due (what runs between two lines: a clock read and a comparison per token step), and
progress due at every token step writing to a discarded stream (the worst case: a line per token
step). Each figure is the ratio of the median seconds to the baseline's.

    python benchmarks/progress_overhead.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.observe.step_progress import StepProgress
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.hf_engine import HFEngine


def _engine() -> HFEngine:
    cfg = Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None)
    torch.manual_seed(0)
    return HFEngine(Qwen2ForCausalLM(cfg), eos_token_ids=[])  # no stop token: every response runs to the limit


def _sinks() -> dict[str, StepProgress | None]:
    never = StepProgress(1, 1e9, stream=io.StringIO(), tty=False)
    never.begin_step(1)
    always = StepProgress(1, 0.0, stream=io.StringIO(), tty=False)
    always.begin_step(1)
    return {"none": None, "never due": never, "due every token step": always}


def measure(repeats: int = 7, prompts: int = 32, n: int = 4, tokens: int = 256) -> dict:
    engine = _engine()
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=1)
    batch = [[5 + i % 50, 6, 7] for i in range(prompts)]
    sinks, seconds = _sinks(), {}
    engine.generate(batch, n, params)  # warm-up: the first generation pays one-time costs
    for r in range(repeats):
        names = list(sinks)
        for name in names[r % 3:] + names[:r % 3]:  # interleaved, rotated: drift and order hit all alike
            sink = sinks[name]
            engine.on_progress = sink
            started = time.perf_counter()
            engine.generate(batch, n, params)
            seconds.setdefault(name, []).append(time.perf_counter() - started)
    base = statistics.median(seconds["none"])
    return {"responses": prompts * n, "tokens_each": tokens, "repeats": repeats,
            "median_s": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
            "ratio_to_none": {k: round(statistics.median(v) / base, 3) for k, v in seconds.items()}}


def run(quick: bool) -> dict:
    result = measure(repeats=3 if quick else 7)
    ratio = result["ratio_to_none"]
    figures = [dict(figure=f"HF decode loop, progress {name}", value=result["median_s"][name], unit="s",
                    baseline_name="no progress", baseline=result["median_s"]["none"], ratio=ratio[name],
                    target="<= 1.02" if name == "never due" else None,
                    met=ratio[name] <= 1.02 if name == "never due" else None)
               for name in ("never due", "due every token step")]
    markdown = "\n".join(["| progress | median s | ratio to none |", "|---|---|---|"]
                         + [f"| {k} | {v:.3f} | {ratio[k]:.3f} |" for k, v in result["median_s"].items()])
    return dict(name="progress_overhead", figures=figures, markdown=markdown, details=result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    print(json.dumps(measure(parser.parse_args().repeats), indent=1))


if __name__ == "__main__":
    main()
