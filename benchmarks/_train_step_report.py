"""The report of benchmarks/train_step.py: the figures run_all tabulates and the markdown the
benchmark prints, from the results train_step.py's parent gathers (both sides' best update and
peak memory per case, and the profiles when taken)."""

from __future__ import annotations

from _train_step_cases import Case

SPEED_TARGET, MEMORY_TARGET = 1.3, 0.5  # benchmarks/train_step.py's targets, judged at the full sizes only


def figures(name: str, result: dict, quick: bool) -> list[dict]:
    """The issue's targets hold at the full sizes; quick sizes (a smoke run) report ratios only."""
    hf, mg = result["hf"], result["megatron"]
    speed, memory = mg["tokens_per_s"] / hf["tokens_per_s"], mg["peak_mb"] / hf["peak_mb"]
    baseline = "HF transformers (Qwen2ForCausalLM, log_softmax, AdamW)"
    return [
        dict(figure=f"{name}: megatron tokens/s", value=mg["tokens_per_s"], unit="tokens/s",
             baseline_name=baseline, baseline=hf["tokens_per_s"], ratio=speed,
             target=None if quick else f">= {SPEED_TARGET}x", met=None if quick else speed >= SPEED_TARGET),
        dict(figure=f"{name}: megatron peak RSS above imports", value=mg["peak_mb"], unit="MB",
             baseline_name=baseline, baseline=hf["peak_mb"], ratio=memory,
             target=None if quick else f"<= {MEMORY_TARGET}x",
             met=None if quick else memory <= MEMORY_TARGET),
    ]


def render_markdown(cases: dict[str, Case], results: dict[str, dict], quick: bool, rounds: int,
                    load: tuple[float, float]) -> str:
    case = next(iter(cases.values()))
    lines = [("Quick sizes (a smoke run; the targets apply to the full sizes): " if quick else "")
             + f"{case.layers['num_hidden_layers']} layers, hidden {case.layers['hidden_size']}, "
             f"ffn {case.layers['intermediate_size']}, {case.layers['num_attention_heads']} heads / "
             f"{case.layers['num_key_value_heads']} KV, fp32, {case.seqs} x {case.seq_len} tokens "
             f"({case.seq_len - case.prompt} response tokens each), {case.threads} threads, "
             f"best of {case.updates} updates after 1 warm-up x {rounds} alternating run(s) per side; "
             f"load average {load[0]:.2f} at the start, {load[1]:.2f} at the end",
             "",
             "| case | HF tokens/s | megatron tokens/s | speed ratio" + ("" if quick else " (>= 1.3)")
             + " | HF peak MB | megatron peak MB | memory ratio" + ("" if quick else " (<= 0.5)")
             + " | loss diff |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        hf, mg = r["hf"], r["megatron"]
        speed, memory = mg["tokens_per_s"] / hf["tokens_per_s"], mg["peak_mb"] / hf["peak_mb"]
        met = lambda ok: "" if quick else (" met" if ok else " not met")
        lines.append(f"| {name} | {hf['tokens_per_s']:.0f} | {mg['tokens_per_s']:.0f} | {speed:.2f}x"
                     f"{met(speed >= SPEED_TARGET)} | {hf['peak_mb']:.0f} | {mg['peak_mb']:.0f} "
                     f"| {memory:.2f}x{met(memory <= MEMORY_TARGET)} | {r['loss_diff']:.1e} |")
    lines += ["", "| case | side | params MB | grads MB | Adam states MB | peak - those MB |",
              "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for side in ("hf", "megatron"):
            st = r[side]["static_mb"]
            rest = r[side]["peak_mb"] - sum(st.values())
            lines.append(f"| {name} | {side} | {st['params']:.0f} | {st['grads']:.0f} "
                         f"| {st['optimizer_states']:.0f} "
                         f"| {rest:.0f} |")
    for name, r in results.items():
        if "profile" in r["megatron"]:
            lines += ["", _profile_markdown(name, r["megatron"]["profile"], r["megatron"]["static_mb"])]
        if "profile" in r["megatron"] and "profile" in r["hf"]:
            lines += ["", _kinds_markdown(name, r["hf"]["profile"], r["megatron"]["profile"])]
    return "\n".join(lines)


def _profile_markdown(name: str, prof: dict, static: dict) -> str:
    t = prof["time_ms"]
    get = lambda *keys: sum(t.get(k, 0.0) + t.get(k + ":matmul", 0.0) for k in keys)
    total = sum(t.values())
    rows = [("log-prob path forward: matmuls (logits; with the hint, the input and weight gradients)",
             t.get("logprobs_fwd:matmul", 0.0)),
            ("log-prob path forward: softmax, gather, entropy, gradient passes, loss hint",
             t.get("logprobs_fwd", 0.0)),
            ("log-prob path backward: matmuls (recompute and gradients; none when the hint held)",
             t.get("logprobs_bwd:matmul", 0.0)),
            ("log-prob path backward: other", t.get("logprobs_bwd", 0.0)),
            ("layers + embedding forward", get("forward")),
            ("layers + embedding backward (and the loss's)", get("backward")),
            ("finalize_model_grads (DP reduce, world of one)", get("finalize_grads")),
            ("optimizer: torch AdamW", get("adamw")),
            ("optimizer: megatron wrapper (grad norm, clip, zeroing, copies)", get("optimizer")),
            ("step overheads (batching, schedule, loss, metrics)", get("update", "unlabelled"))]
    lines = [(f"Profile of one megatron update, {name} (torch.profiler, self CPU time by innermost label; "
              f"update wall {prof['wall_s']:.2f} s):"), "", "| where | ms | share |", "|---|---|---|"]
    lines += [f"| {label} | {ms:.0f} | {ms / total:.1%} |" for label, ms in rows]
    m = prof["peak_mb"]
    names = {"forward": "layer activations (saved in the forward)",
             "logprobs_fwd": "log-prob forward (chunk buffers; the output layer's gradients)",
             "backward": "layer backward (gradients in flight)",
             "logprobs_bwd": "log-prob backward (chunk buffers, output-layer grads)",
             "finalize_grads": "finalize_model_grads", "optimizer": "megatron optimizer", "adamw": "AdamW",
             "update": "step (batches, schedule, loss)", "unlabelled": "unlabelled"}
    lines += ["", "What holds the memory at that update's peak (MB; tensors, not RSS):", "",
              "| what | MB |", "|---|---|",
              f"| parameters | {static['params']:.0f} |",
              f"| DDP fp32 grad buffer (main_grad) | {static['grads']:.0f} |",
              f"| Adam states (exp_avg, exp_avg_sq) | {static['optimizer_states']:.0f} |"]
    lines += [f"| {names.get(k, k)} | {v:.0f} |" for k, v in sorted(m.items(), key=lambda kv: -kv[1])
              if k != "total"]
    lines.append(f"| peak above the update's start (sum of the rows after Adam) | {m['total']:.0f} |")
    return "\n".join(lines)


def _kinds_markdown(name: str, hf: dict, mg: dict) -> str:
    """Both sides' profiled update by kind of op, and what the speed target leaves: megatron's
    whole update must take at most HF's / SPEED_TARGET."""
    total = lambda p: sum(p["kind_ms"].values())
    fixed = lambda p: p["kind_ms"]["matmul"] + p["kind_ms"]["attention"]
    lines = [f"Both profiled updates by kind of op, {name} (self CPU ms; the profiler's own overhead "
             "included, so totals exceed the timed updates):", "",
             "| kind | HF | megatron |", "|---|---|---|"]
    labels = {"matmul": "matrix products (layers, output layer)", "attention": "fused attention kernel (SDPA)",
              "other": "everything else (element-wise, softmax, norms, optimizer, copies)"}
    lines += [f"| {labels[k]} | {hf['kind_ms'][k]:.0f} | {mg['kind_ms'][k]:.0f} |" for k in labels]
    lines.append(f"| total | {total(hf):.0f} | {total(mg):.0f} |")
    budget = total(hf) / SPEED_TARGET
    lines += ["", f"The {SPEED_TARGET}x speed target leaves megatron {budget:.0f} ms for the whole update; its "
              f"matrix products and attention kernel alone take {fixed(mg):.0f} ms (HF's: {fixed(hf):.0f} ms)."]
    return "\n".join(lines)

