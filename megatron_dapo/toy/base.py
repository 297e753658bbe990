"""The tiny base model of the CPU demo: a Qwen2 (or Qwen3, Qwen3-MoE) architecture that knows the format, not the task.

``make_toy_base`` builds a ``transformers.Qwen2ForCausalLM`` from scratch (grouped-query attention,
QKV bias, RMSNorm, RoPE, SwiGLU: the Qwen2.5 layout at toy width; ``toy.architecture=qwen3``: a
``Qwen3ForCausalLM``, no biases, per-head query/key RMSNorm; ``qwen3_moe``: a ``Qwen3MoeForCausalLM``,
every MLP a router over toy.num_experts experts) and trains it for a few seconds
by supervised warm-up on toy prompts whose responses have the right FORMAT (optional reasoning
line, then "Answer: N", then <|im_end|>) but a uniformly RANDOM digit as the answer. Cross-entropy
on random labels teaches the answer marginal (uniform over 0..9) and nothing about the question,
so the base emits parsable answers but is right 1 time in 10: RL has to do all the learning, as
DAPO does from a base model that only follows the prompt's output format.

Output directory (what ``model.hf_path`` points at, loaded like a Qwen2.5 checkpoint):
config.json, generation_config.json (eos = [<|im_end|>, <|endoftext|>]), model.safetensors, the
tokenizer files of ``toy/tokenizer.py``, and warmup.json (settings and the base's measured
format rate and accuracy).

Determinism: everything is seeded from ``seed``; on the same machine and thread count the weights
are bit-identical run to run.

The warm-up check samples and scores through the library's own path (the HF rollout engine,
eval.evaluate, the value scorer): there is one sampler and one evaluator in the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dapo.config import ToyConfig
from megatron_dapo.toy import task as toy_task
from megatron_dapo.toy import tokenizer as toy_tokenizer

# Settings of this module (task size, model shape, warm-up) are ``config.ToyConfig`` (the ``toy:``
# section); ``enable`` there is the trainer's switch and is not used here.
_CLI_SKIP = ("enable",)


def toy_hf_config(cfg: ToyConfig, tokenizer) -> Any:
    """The base's transformers config: Qwen2 (toy.architecture=qwen2), Qwen3 dense (qwen3) or Qwen3-MoE
    (qwen3_moe: toy.num_experts experts of toy.moe_intermediate_size, top toy.num_experts_per_tok,
    renormalised as Qwen3-30B-A3B's router is)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False,
        bos_token_id=None, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
    )
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads  # Qwen3's own default is 128
    if cfg.architecture == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, attention_bias=False, architectures=["Qwen3ForCausalLM"])
    if cfg.architecture == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=head_dim, attention_bias=False, num_experts=cfg.num_experts,
                              num_experts_per_tok=cfg.num_experts_per_tok,
                              moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
    return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])


def stop_token_ids(tokenizer) -> list[int]:
    """<|im_end|> ends an assistant turn; <|endoftext|> ends a document (Qwen2.5-Instruct's list)."""
    return [tokenizer.convert_tokens_to_ids(toy_tokenizer.IM_END), tokenizer.eos_token_id]


def batch_prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """Chat-templated token ids of one-message user prompts (the trainer's apply_chat_template path)."""
    from megatron_dapo.data.tokenize import apply_chat_template

    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def _fast_prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """``batch_prompt_ids`` with the chat template rendered once instead of once per question.

    Rendering the Jinja template per prompt is most of the warm-up's data time. The
    question sits between special tokens, which tokenize apart from their neighbours, so
    splicing it into the rendered text gives the same ids (tests/unit/test_toy_base.py checks).
    """
    marker = "{question}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    prefix, suffix = text.split(marker)
    return tokenizer([prefix + q + suffix for q in questions], add_special_tokens=False)["input_ids"]


def warmup_batch(tokenizer, rng: random.Random, cfg: ToyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, S] and labels [B, S] (-100 outside the response) with random answers."""
    im_end = tokenizer.convert_tokens_to_ids(toy_tokenizer.IM_END)
    problems = [toy_task.sample_problem(rng, cfg.num_digits, cfg.min_digits)[0] for _ in range(cfg.warmup_batch_size)]
    prompts = _fast_prompt_ids(tokenizer, [toy_task.format_question(d) for d in problems])
    # Uniform answers, independent of the question: the base must learn the format, not the task.
    responses = [toy_task.format_response(d, rng.randrange(10), reasoning=rng.random() < cfg.reasoning_prob)
                 for d in problems]
    targets = [ids + [im_end] for ids in tokenizer(responses, add_special_tokens=False)["input_ids"]]
    seqs = [p + t for p, t in zip(prompts, targets)]
    labels = [[-100] * len(p) + t for p, t in zip(prompts, targets)]
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    return ids, lab


def warm_up(model, tokenizer, cfg: ToyConfig, *, seed: int, log_every: int = 0) -> list[float]:
    """Supervised warm-up in place; returns the loss of every step."""
    rng = random.Random(f"toy-warmup-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(cfg.warmup_steps):
        ids, labels = warmup_batch(tokenizer, rng, cfg)
        # Padding sits after each sequence's end and is excluded from the loss by -100 labels,
        # so causal attention never lets a real token see it: no attention mask is needed.
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == cfg.warmup_steps - 1):
            print(f"warmup step {step:4d} loss {losses[-1]:.4f}", flush=True)
    model.eval()
    return losses


def evaluate(model, tokenizer, prompts: list[list[int]], ground_truths: list[str], *, num_samples: int,
             temperature: float, top_p: float, max_new_tokens: int, seed: int) -> dict[str, float]:
    """Held-out metrics of ``model`` through the trainer's evaluation (eval.evaluate on the HF engine,
    scored inline by our value scorer): ``acc_mean`` (avg@k), ``pass_at_k``, ``format_rate`` (the
    answer is an integer) and ``response_length_mean`` (tokens, including the stop token)."""
    from megatron_dapo.eval import evaluate as evaluate_engine
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.rollout.placement import RolloutPlacement

    was_training = model.training
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed,
                            stop_token_ids=tuple(stop_token_ids(tokenizer)), logprobs=False)
    placement = RolloutPlacement(HFEngine(model, pad_token_id=tokenizer.pad_token_id), alone=True)
    with RewardPool(num_workers=0, timeout_s=10.0) as pool:  # inline: toy responses are short
        out = evaluate_engine(placement, prompts, ground_truths, tokenizer=tokenizer, params=params,
                              n=num_samples, pool=pool, prefix="")
    model.train(was_training)
    return {"acc_mean": out[f"avg@{num_samples}"], "pass_at_k": out[f"pass@{num_samples}"],
            "format_rate": out["format_rate"], "response_length_mean": out["response_length_mean"]}


def make_toy_base(out_dir: str | Path, *, seed: int, cfg: ToyConfig, eval_rows: list[dict] | None = None,
                  log_every: int = 0) -> Path:
    """Build, warm up and save the toy base model into ``out_dir``; returns ``out_dir``.

    ``eval_rows`` (DAPO-schema rows, e.g. the validation split): when given, the base's format
    rate and accuracy at temperature 1 are measured and stored in warmup.json.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir = Path(out_dir)
    toy_tokenizer.save_toy_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)  # the path the trainer takes
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(toy_hf_config(cfg, tokenizer)).float()
    start = time.perf_counter()
    losses = warm_up(model, tokenizer, cfg, seed=seed, log_every=log_every)
    report: dict[str, Any] = {"seed": seed, "config": dataclasses.asdict(cfg),
                              "num_parameters": sum(p.numel() for p in model.parameters()),
                              "final_loss": losses[-1] if losses else None,
                              "warmup_seconds": round(time.perf_counter() - start, 2)}
    if eval_rows:
        prompts = batch_prompt_ids(tokenizer, [r["prompt"][0]["content"] for r in eval_rows])
        truths = [r["reward_model"]["ground_truth"] for r in eval_rows]
        report["eval_temperature_1"] = evaluate(
            model, tokenizer, prompts, truths, num_samples=4, temperature=1.0, top_p=1.0,
            max_new_tokens=2 * max_response_tokens(cfg), seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    stops = stop_token_ids(tokenizer)
    GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                     do_sample=True, temperature=1.0, top_p=1.0).save_pretrained(out_dir)
    (out_dir / "warmup.json").write_text(json.dumps(report, indent=2) + "\n")
    return out_dir


def max_response_tokens(cfg: ToyConfig) -> int:
    """Tokens of the longest well-formed response (with reasoning), including <|im_end|>."""
    # "Check", " ", the digits, ".\n", "Answer", ":", " ", the answer digit, <|im_end|>
    return cfg.num_digits + 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the toy base model (format-only warm-up).")
    parser.add_argument("--out", required=True, help="output directory (HF format)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", help="also write train/val parquet files of the toy task here")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    for f in dataclasses.fields(ToyConfig):
        if f.name in _CLI_SKIP:
            continue
        kind = _bool if isinstance(f.default, bool) else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                            help=f.metadata["help"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ToyConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ToyConfig)
                       if f.name not in _CLI_SKIP})
    _, val = toy_task.make_splits(seed=args.seed, num_train=cfg.num_train, num_val=cfg.num_val,
                                  num_digits=cfg.num_digits, min_digits=cfg.min_digits)
    if args.data:
        paths = toy_task.write_toy_dataset(args.data, seed=args.seed, num_train=cfg.num_train,
                                           num_val=cfg.num_val, num_digits=cfg.num_digits,
                                           min_digits=cfg.min_digits)
        print("\n".join(map(str, paths)))
    out = make_toy_base(args.out, seed=args.seed, cfg=cfg, eval_rows=val, log_every=25)
    print((out / "warmup.json").read_text())


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return text.lower() in ("true", "1")


if __name__ == "__main__":
    main()
