"""DAPO on the toy task in plain PyTorch + transformers: does it learn on 2 CPU cores, and how fast?

The reference numbers for the embedded default (``megatron-dapo train --config conf/cpu_tiny.yaml``)
before the Megatron path exists: the same task, tokenizer, base model, reward and algorithm
functions, with an HF model as both trainer and rollout engine. Prints held-out accuracy before
and after, one line per step, and the wall time of each phase. The baseline of the ratio it
prints is the base model measured in the same run: final / initial held-out accuracy.

Everything DAPO is on: Clip-Higher (0.2 / 0.28, dual clip 10), dynamic sampling (mixed groups
only, at most ``--max-num-gen-batches`` generation batches), token-mean loss over each
mini-batch, soft overlong punishment; no KL, no reference model. Old log-probs are the rollout's
own: sampler and trainer are one fp32 model, so they agree to round-off (logged as
rollout/logprob_mismatch). The defaults below are the tuned settings (see the summary it prints).

Deviation (``--on-exhausted partial``, the default): when the generation batches run out before
``prompts_per_step`` mixed groups are found, the step trains on the mixed groups it has instead
of raising as verl does. Near convergence almost every group is all-correct; raising would end
the toy run at step ~80-120, and an unbounded search makes each late step much slower.

Simplifications against the real loop (kept out on purpose; the trainer does them): one process,
no checkpointing, no weight sync, rewards scored inline.

    python benchmarks/toy_rl_prototype.py [--seed 1] [--steps 100] [--run-dir runs/toy_rl_prototype]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.algo import (  # noqa: E402
    DynamicSampler, compute_grpo_advantages, compute_policy_loss, overlong_penalty)
from megatron_dapo.data import PromptSampler, load_prompts, tokenize_prompts  # noqa: E402
from megatron_dapo.data.toy_task import write_toy_dataset  # noqa: E402
from megatron_dapo.metrics_log import MetricsLogger, format_progress  # noqa: E402
from megatron_dapo.reward import compute_score  # noqa: E402
from megatron_dapo.toy_base import ToyConfig, evaluate, generate, make_toy_base, stop_token_ids  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--seed", type=int, default=1)
    add("--threads", type=int, default=1, help="torch threads (1 is far faster on shared cores)")
    add("--base", help="an existing toy base dir; default: build one (timed)")
    add("--run-dir", default="runs/toy_rl_prototype")
    add("--steps", type=int, default=100, help="rollout steps")
    add("--time-budget-s", type=float, default=0, help="stop RL after this many seconds; 0 = off")
    add("--stop-at-acc", type=float, default=0, help="stop once held-out avg@n reaches this; 0 = off")
    add("--target-acc", type=float, default=0.8, help="report when held-out avg@n first reaches this")
    add("--prompts-per-step", type=int, default=16)
    add("--gen-prompts-per-batch", type=int, default=24)
    add("--group-size", type=int, default=8)
    add("--max-num-gen-batches", type=int, default=8)
    add("--on-exhausted", choices=("error", "partial"), default="partial",
        help="generation batches spent before the batch is full: raise (verl), or train on the groups held")
    add("--mini-batch-prompts", type=int, default=4, help="groups per optimizer update (4 updates per step)")
    add("--lr", type=float, default=1e-3)
    add("--lr-warmup-steps", type=int, default=3)
    add("--weight-decay", type=float, default=0.0)
    add("--clip-grad", type=float, default=1.0)
    add("--clip-ratio-low", type=float, default=0.2)
    add("--clip-ratio-high", type=float, default=0.28)
    add("--clip-ratio-c", type=float, default=10.0)
    add("--loss-agg-mode", default="token-mean")
    add("--max-response-length", type=int, default=16)
    add("--overlong-buffer", type=int, default=4)
    add("--overlong-penalty-factor", type=float, default=1.0)
    add("--eval-every", type=int, default=10)
    add("--eval-n", type=int, default=4, help="samples per held-out problem (avg@n)")
    add("--eval-top-p", type=float, default=0.7, help="DAPO eval: temperature 1.0, top-p 0.7")
    for f in dataclasses.fields(ToyConfig):
        if f.name == "enable":  # the trainer's switch; the prototype always uses the toy task
            continue
        kind = (lambda s: s.lower() in ("1", "true")) if isinstance(f.default, bool) else type(f.default)
        add("--toy-" + f.name.replace("_", "-"), dest="toy_" + f.name, default=f.default, type=kind)
    return p.parse_args(argv)


def rollout(model, tokenizer, prompts, truths, args, gen):
    """Sample G responses per prompt and score them; returns one dict per prompt group, and acc [P, G]."""
    G = args.group_size
    stops = stop_token_ids(tokenizer)
    tokens, logps, lengths = generate(model, torch.tensor(prompts).repeat_interleave(G, 0),
                                      max_new_tokens=args.max_response_length, temperature=1.0, top_p=1.0,
                                      stop_ids=stops, pad_id=tokenizer.pad_token_id, generator=gen)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    scores = [compute_score(t, truths[i // G]) for i, t in enumerate(texts)]
    score = torch.tensor([s["score"] for s in scores]).view(-1, G)
    acc = torch.tensor([s["acc"] for s in scores]).view(-1, G)
    penalty = overlong_penalty(lengths, max_response_len=args.max_response_length,
                               buffer_len=args.overlong_buffer,
                               penalty_factor=args.overlong_penalty_factor).view(-1, G)
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    truncated = ~torch.isin(last, torch.tensor(stops)).view(-1, G)
    T = tokens.shape[1]
    return [dict(prompt=prompts[p], tokens=tokens.view(-1, G, T)[p], logps=logps.view(-1, G, T)[p],
                 lengths=lengths.view(-1, G)[p], reward=score[p] + penalty[p], penalty=penalty[p],
                 truncated=truncated[p]) for p in range(len(prompts))], acc


def collect_batch(model, tokenizer, train_ids, train_truths, sampler, dyn, args, gen):
    """Dynamic sampling: generation batches until prompts_per_step mixed groups (or the bound).

    Returns (groups, metrics); groups may be short (or empty) only with --on-exhausted partial.
    """
    dyn.start_step()
    accs, groups_seen, num_batches = [], [], 0
    while not dyn.is_full and (args.max_num_gen_batches == 0 or num_batches < args.max_num_gen_batches):
        idx = sampler.next_indices(args.gen_prompts_per_batch)
        groups, acc = rollout(model, tokenizer, [train_ids[i] for i in idx], [train_truths[i] for i in idx],
                              args, gen)
        accs.append(acc.float().mean())
        groups_seen += groups
        dyn.add(groups, acc)  # raises DynamicSamplingExhausted itself in "error" mode
        num_batches += 1
    if dyn.is_full:
        batch, metrics = dyn.pop()
    else:
        batch = dyn.state_dict()["held"]
        dyn.load_state_dict({"held": []})
        metrics = {"dynamic_sampling/num_gen_batches": num_batches,
                   "dynamic_sampling/num_groups_kept": len(batch), "dynamic_sampling/partial_batch": 1.0}
    lengths = torch.cat([g["lengths"] for g in groups_seen]).float()
    metrics.update({
        "reward/acc_mean": torch.stack(accs).mean(),  # every response generated this step
        "reward/overlong_penalty_mean": torch.cat([g["penalty"] for g in groups_seen]).mean(),
        "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
        "response_length/clip_ratio": torch.cat([g["truncated"] for g in groups_seen]).float().mean(),
    })
    if batch:
        metrics["reward/score_mean"] = torch.stack([g["reward"] for g in batch]).mean()  # the trained groups
    return batch, metrics


def _fit(x, width, fill):
    """[G, T'] -> [G, width]: cut or pad (groups of different generation batches differ in T')."""
    return x[:, :width] if x.shape[1] >= width else F.pad(x, (0, width - x.shape[1]), value=fill)


def train_on(model, opt, groups, args, pad_id):
    """One rollout step's updates: mini-batches of groups, token-mean DAPO loss. Returns metrics."""
    adv_all = compute_grpo_advantages(torch.stack([g["reward"] for g in groups]))  # [P, G]
    sums: dict[str, torch.Tensor] = {}
    num_updates = 0
    for start in range(0, len(groups), args.mini_batch_prompts):
        mb = groups[start:start + args.mini_batch_prompts]
        T = max(int(g["lengths"].max()) for g in mb)
        prompt = torch.tensor([g["prompt"] for g in mb]).repeat_interleave(args.group_size, 0)  # [N, Lp]
        resp = torch.cat([_fit(g["tokens"], T, pad_id) for g in mb])                          # [N, T]
        old = torch.cat([_fit(g["logps"], T, 0.0) for g in mb])
        mask = (torch.arange(T)[None] < torch.cat([g["lengths"] for g in mb])[:, None]).float()
        adv = adv_all[start:start + len(mb)].reshape(-1)
        Lp = prompt.shape[1]
        # Padding sits after each response and is masked, and attention is causal: no attention mask.
        logits = model(input_ids=torch.cat([prompt, resp], 1)).logits[:, Lp - 1:Lp - 1 + T].float()
        logp_all = F.log_softmax(logits, -1)  # temperature 1.0, as sampled
        logp = logp_all.gather(-1, resp[..., None]).squeeze(-1)
        loss, metrics = compute_policy_loss(
            logp, old, adv, mask, clip_ratio_low=args.clip_ratio_low, clip_ratio_high=args.clip_ratio_high,
            clip_ratio_c=args.clip_ratio_c, loss_agg_mode=args.loss_agg_mode)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        metrics["actor/grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        with torch.no_grad():
            metrics["actor/entropy"] = (-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / mask.sum()
            if num_updates == 0:  # before any update the trainer's policy is the sampler's
                metrics["rollout/logprob_mismatch"] = ((logp - old).abs().exp() * mask).sum() / mask.sum()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0) + v.detach()
        num_updates += 1
    out = {k: v if k == "rollout/logprob_mismatch" else v / num_updates for k, v in sums.items()}
    out["actor/num_updates"] = float(num_updates)
    return out


@torch.no_grad()
def print_samples(model, tokenizer, prompts, truths, args):
    tokens, _, lengths = generate(model.eval(), torch.tensor(prompts),
                                  max_new_tokens=args.max_response_length,
                                  temperature=1.0, top_p=1.0, stop_ids=stop_token_ids(tokenizer),
                                  pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    for p, t, n, gt in zip(prompts, tokens, lengths.tolist(), truths):
        print(f"  {tokenizer.decode(p)!r} -> {tokenizer.decode(t[:n])!r} (truth {gt})")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    cfg = ToyConfig(**{f.name: getattr(args, "toy_" + f.name) for f in dataclasses.fields(ToyConfig)
                       if f.name != "enable"})
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="toy_rl_"))
    train_path, val_path = write_toy_dataset(work / "data", seed=args.seed, num_train=cfg.num_train,
                                             num_val=cfg.num_val, num_digits=cfg.num_digits)
    base = Path(args.base) if args.base else make_toy_base(work / "base", seed=args.seed, cfg=cfg)
    t_base = time.perf_counter() - t_start
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32)
    train, val = load_prompts(train_path).records, load_prompts(val_path).records
    train_ids, val_ids = tokenize_prompts(tokenizer, train), tokenize_prompts(tokenizer, val)
    train_truths, val_truths = [r.ground_truth for r in train], [r.ground_truth for r in val]

    def held_out(step, *, n=args.eval_n, top_p=args.eval_top_p, temperature=1.0):
        return evaluate(model, tokenizer, val_ids, val_truths, num_samples=n, temperature=temperature,
                        top_p=top_p, max_new_tokens=args.max_response_length, seed=args.seed * 1000 + step)

    def all_evals(step):
        return {"eval": held_out(step), "t1": held_out(step, top_p=1.0),
                "greedy": held_out(step, n=1, temperature=0.0)}

    before = all_evals(0)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"base ready in {t_base:.1f}s ({num_params} params); held-out before RL: "
          + "  ".join(f"{k} acc {v['acc_mean']:.3f} fmt {v['format_rate']:.3f}" for k, v in before.items()),
          flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay)
    sampler = PromptSampler(len(train), seed=args.seed)
    # With "partial" the loop enforces the bound (collect_batch); with "error" the sampler raises.
    dyn = DynamicSampler(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                         max_num_gen_batches=args.max_num_gen_batches if args.on_exhausted == "error" else 0)
    gen = torch.Generator().manual_seed(args.seed)
    log = MetricsLogger(args.run_dir, tensorboard=False, wandb=False, wandb_project="", config=vars(args),
                        enabled=True, start_step=0)
    log.log(0, {f"eval/{k}": v for k, v in before["eval"].items()})
    t_rl, step, first_hit = time.perf_counter(), 0, None
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / max(1, args.lr_warmup_steps))
        model.train()
        with log.timer("step"):
            with log.timer("gen"):
                batch, metrics = collect_batch(model, tokenizer, train_ids, train_truths, sampler, dyn, args,
                                               gen)
            if batch:
                with log.timer("train"):
                    metrics.update(train_on(model, opt, batch, args, tokenizer.pad_token_id))
            metrics["actor/lr"] = opt.param_groups[0]["lr"]
            if step % args.eval_every == 0 or step == args.steps:
                with log.timer("eval"):
                    metrics.update({f"eval/{k}": v for k, v in held_out(step).items()})
        values = log.log(step, metrics)
        print(format_progress(step, values, total_steps=args.steps), flush=True)
        if first_hit is None and values.get("eval/acc_mean", 0.0) >= args.target_acc:
            first_hit = (step, time.perf_counter() - t_rl)
        if args.stop_at_acc and values.get("eval/acc_mean", 0.0) >= args.stop_at_acc:
            break
        if args.time_budget_s and time.perf_counter() - t_rl > args.time_budget_s:
            break
    t_rl = time.perf_counter() - t_rl
    log.close()
    print_samples(model, tokenizer, val_ids[:4], val_truths[:4], args)
    after = all_evals(10**6)
    print(f"\n=== toy DAPO prototype (seed {args.seed}, {args.threads} thread(s)) ===")
    print(f"model: {num_params} params; data + base built in {t_base:.1f}s")
    for k, name in (("eval", f"avg@{args.eval_n} T=1 top_p={args.eval_top_p}"),
                    ("t1", f"avg@{args.eval_n} T=1 top_p=1"), ("greedy", "greedy")):
        b, a = before[k]["acc_mean"], after[k]["acc_mean"]
        print(f"held-out acc ({name}): before {b:.3f} -> after {a:.3f}  (x{a / max(b, 1e-9):.1f}); "
              f"format {after[k]['format_rate']:.3f}; len {after[k]['response_length_mean']:.2f}")
    if first_hit:
        print(f"held-out acc first >= {args.target_acc} at step {first_hit[0]}, {first_hit[1]:.1f}s into RL")
    print(f"RL: {step} steps in {t_rl:.1f}s ({t_rl / max(step, 1):.2f} s/step); "
          f"total wall {time.perf_counter() - t_start:.1f}s")
    print(f"metrics: {Path(args.run_dir) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
