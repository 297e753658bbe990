"""TRL's side of benchmarks/peer_trl.py: Hugging Face TRL's ``GRPOTrainer`` configured as DAPO on the
demo's own base model, prompts and scorer, in its own process (under torchrun for DP=2). Prints one
JSON line: per-step seconds, wall, tokens, peak RSS and the held-out metrics of the trained model
through our evaluator (toy.base.evaluate), so both sides are scored by the same code.

What is matched with our side (peer_trl.py passes both the same numbers): base weights, train and
held-out prompts (chat-templated by the same tokenizer), group size, prompts per step, response
limit, the updates per step (``steps_per_generation`` = our mini-batches per step, so TRL recomputes
old log-probs as we do), lr and its warm-up (in updates: TRL counts optimizer steps), AdamW
settings, gradient clip, Clip-Higher (0.2 / 0.28), the dual clip (``delta`` = our clip_ratio_c),
beta 0, the token-level loss (``loss_type="dapo"``), the paper's scorer plus the soft overlong
penalty as the reward, fp32 and one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in (("base", str), ("train", str), ("val", str), ("out", str), ("seed", int), ("steps", int),
                       ("prompts_per_step", int), ("group_size", int), ("max_tokens", int), ("updates_per_step", int),
                       ("lr", float), ("warmup_updates", int), ("clip_grad", float), ("clip_low", float),
                       ("clip_high", float), ("clip_c", float), ("buffer_len", int), ("penalty_factor", float),
                       ("eval_n", int), ("eval_top_p", float), ("eval_max_tokens", int), ("threads", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, required=True)
    return p.parse_args(argv)


def reward_fn(args):
    """Our paper scorer (+-1) plus the soft overlong penalty, as our reward worker computes it."""
    import torch

    from megatron_dapo.algo.reward_shaping import overlong_penalty
    from megatron_dapo.reward import PAPER_REWARD_FN, get_reward_fn

    score = get_reward_fn(PAPER_REWARD_FN)

    def dapo_reward(prompts, completions, completion_ids, ground_truth, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = overlong_penalty(lengths, max_response_len=args.max_tokens, buffer_len=args.buffer_len,
                                   penalty_factor=args.penalty_factor)
        return [float(score(t, gt)["score"]) + float(p) for t, gt, p in zip(texts, ground_truth, penalty)]

    return dapo_reward


def held_out(model, tokenizer, val_path: str, *, n: int, top_p: float, max_tokens: int, seed: int) -> dict:
    """Held-out metrics of a trained HF model through our evaluator (toy.base.evaluate); both sides'."""
    import pyarrow.parquet as pq

    from megatron_dapo.toy.base import batch_prompt_ids, evaluate

    val = pq.read_table(val_path).to_pylist()
    prompts = batch_prompt_ids(tokenizer, [r["prompt"][0]["content"] for r in val])
    return evaluate(model, tokenizer, prompts, [r["reward_model"]["ground_truth"] for r in val], num_samples=n,
                    temperature=1.0, top_p=top_p, max_new_tokens=max_tokens, seed=seed)


class StepClock:
    """A TrainerCallback's two hooks: the seconds of each optimizer step (generation happens inside
    the first step of each group of ``steps_per_generation``)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._t = 0.0

    def on_step_begin(self, *_, **__):
        self._t = time.perf_counter()

    def on_step_end(self, *_, **__):
        self.seconds.append(time.perf_counter() - self._t)


def main(argv=None) -> None:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from _rss import TreePeak  # benchmarks/, this script's directory

    tree = TreePeak()
    start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    rows = pq.read_table(args.train).to_pylist()
    train = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                               for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    responses = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=args.out, seed=args.seed, use_cpu=True, bf16=False, fp16=False, report_to=[],
        per_device_train_batch_size=responses // args.updates_per_step // world, gradient_accumulation_steps=1,
        steps_per_generation=args.updates_per_step, num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        max_steps=args.steps * args.updates_per_step, learning_rate=args.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_updates, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=args.clip_grad, loss_type="dapo", epsilon=args.clip_low, epsilon_high=args.clip_high,
        delta=args.clip_c, beta=0.0, temperature=1.0, top_p=1.0, top_k=0, scale_rewards="group",
        gradient_checkpointing=False, logging_steps=10**9, save_strategy="no", disable_dropout=True,
        dataloader_num_workers=0, log_completions=False)
    clock = StepClock()
    callback = type("Clock", (TrainerCallback,), {"on_step_begin": clock.on_step_begin,
                                                  "on_step_end": clock.on_step_end})()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(args), args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[callback])
    generate = trainer._generate_and_score_completions
    generate_s: list[float] = []

    def timed_generate(*a, **k):  # TRL's generation + scoring + old log-probs, for the profile
        t = time.perf_counter()
        out = generate(*a, **k)
        generate_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed_generate
    setup_s = time.perf_counter() - start
    t = time.perf_counter()
    if os.environ.get("PEER_PROFILE"):  # peer_trl --profile: training under cProfile
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(trainer.train)
        prof.dump_stats(os.environ["PEER_PROFILE"])
    else:
        trainer.train()
    train_s = time.perf_counter() - t
    per_step = [sum(clock.seconds[i:i + args.updates_per_step])
                for i in range(0, len(clock.seconds), args.updates_per_step)]
    result = {"side": "trl", "world": world, "step_seconds": per_step, "generate_seconds": generate_s,
              "setup_s": setup_s, "train_s": train_s}
    result["peak_rss_mb"] = tree.peak_mb()
    if rank == 0:  # after the peak is read: the evaluation is not part of the training's memory
        model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        result["eval"] = held_out(model, tokenizer, args.val, n=args.eval_n, top_p=args.eval_top_p,
                                  max_tokens=args.eval_max_tokens, seed=args.seed)
    result["wall_s"] = time.perf_counter() - start
    print("PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
