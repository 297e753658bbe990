"""One DAPO update on CPU: MegatronActor (Megatron-Core) vs HF transformers doing the same work.

Both sides start from the same Qwen2 weights (GQA, QKV bias, RMSNorm, SwiGLU, RoPE, untied
embeddings; fp32) and update on the same mini-batch: ``seqs`` random sequences of ``seq_len``
tokens, the last ``seq_len - prompt`` of each a response, per-sequence advantages, old log-probs
near the untrained model's. One update is, on both sides:

  megatron  MegatronActor.get_loss_and_metrics in a world of one (gloo), one micro-batch, local
            spec (attention: torch SDPA, policy/sdpa_attention.py): the
            chunked log-prob path with the output projection fused in (policy/logprobs.py; its
            gradients computed in the forward from the loss's per-token gradient), the DAPO loss
            (algo.compute_policy_loss, token-mean), backward through megatron's schedule and DDP
            buffers, megatron's optimizer (distributed optimizer, grad-norm clip 1.0, torch
            AdamW, no decay on biases and norms), metrics
  hf        Qwen2ForCausalLM forward ([T, V] logits, attention: transformers' default sdpa),
            logits.div_(temperature) and log_softmax gathered at the labels (verl's actor), the
            entropy metric (no grad, 256 positions at a time), the same compute_policy_loss on the
            same mask, backward, clip_grad_norm_(1.0), torch.optim.AdamW with the same groups

at two vocabularies (same layers): 8192, where the layers dominate, and Qwen2's 152064, where
the logits do. Each side runs in its own process; both sides' losses and gradient norms are
checked equal update by update (the same work, the same optimizer).

Time: tokens (seqs x seq_len) per second of one update, the best update of all runs (one
warm-up update per run, then 3 measured; ``--rounds`` alternating runs per side). Memory: the
process's peak RSS (Linux VmHWM, reset through /proc/self/clear_refs once the weights are loaded,
after glibc's malloc_trim hands back what setup freed) minus its RSS right after the imports, the
highest of the runs: weights, gradients, optimizer states, activations and logits, all that the
updates hold. Targets (issue 12): tokens/s
megatron / hf >= 1.3 and peak memory megatron / hf <= 0.5, at both vocabularies (full sizes).
``--recompute full`` runs megatron with model.recompute=full beside HF with gradient
checkpointing; ``selective`` recomputes megatron's core attention only (HF's sdpa kernel already
recomputes its probabilities in backward). ``--profile`` adds a torch.profiler breakdown of one
megatron update (time by component, the tensors alive at its memory peak) and both sides' time
by kind of op (matrix products, attention kernel, the rest), which bounds what any implementation
of the same work can gain. The default full run: both vocabularies without recompute, the small one
also with full recompute on both sides, profiles on.

    python benchmarks/train_step.py                        # 4 layers, hidden 512, 8 x 512 tokens: ~8 min
    python benchmarks/train_step.py --rounds 3 --vocabs qwen --no-profile
    python benchmarks/train_step.py --quick                # small sizes, < 1 min
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2)
QUICK_LAYERS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
VOCABS = {"small": 8192, "qwen": 152064}
QUICK_VOCABS = {"small": 4096, "qwen": 152064}
TEMPERATURE, LR, CLIP, WEIGHT_DECAY = 1.0, 1e-5, 1.0, 0.1
SPEED_TARGET, MEMORY_TARGET = 1.3, 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    vocab: int
    layers: dict
    seqs: int
    seq_len: int
    prompt: int
    updates: int  # measured, after one warm-up
    recompute: str = "none"  # megatron's model.recompute; "full" also turns on HF's gradient checkpointing
    profile: bool = False
    threads: int = 2

    @property
    def tokens(self) -> int:
        return self.seqs * self.seq_len


# -- inside a child process ------------------------------------------------------------------------

def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def _reset_peak() -> None:
    """Return freed heap pages to the OS (glibc keeps what setup freed, e.g. megatron's parameters
    before DDP moved them into one buffer), then restart the peak from the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _hf_config(case: Case) -> dict:
    return dict(model_type="qwen2", vocab_size=case.vocab, **case.layers, rms_norm_eps=1e-6,
                rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
                max_position_embeddings=max(512, case.seq_len), hidden_act="silu", initializer_range=0.02)


def _batch(case: Case):
    """[B, S] ids, [B] advantages, [B, R] old log-probs (R = seq_len - prompt response tokens)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case.vocab, (case.seqs, case.seq_len), generator=g)
    adv = torch.randn(case.seqs, generator=g)
    old = -math.log(case.vocab) + 0.3 * torch.randn(case.seqs, case.seq_len - case.prompt, generator=g)
    return ids, adv, old


def _make_weights(case: Case, path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = _hf_config(case)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**kwargs, rope_theta=1e6)).save_pretrained(path)


def _timed_updates(case: Case, update) -> dict:
    """One warm-up update, then ``case.updates`` measured ones; update() -> (pg_loss, grad_norm)."""
    _reset_peak()
    losses, norms, seconds = [], [], []
    for i in range(1 + case.updates):
        start = time.perf_counter()
        loss, norm = update()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    measured = seconds[1:]
    return dict(losses=losses, grad_norms=norms, seconds=measured, warmup_s=seconds[0],
                best_s=min(measured), tokens_per_s=case.tokens / min(measured))


def _megatron_side(case: Case, weights: str) -> dict:
    from megatron_dapo.policy.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    import megatron.core  # noqa: F401  (in the import baseline, as transformers is on the HF side)

    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, ParallelConfig, RewardConfig,
        RolloutConfig, TrainConfig,
    )
    from megatron_dapo.policy import destroy_parallel
    from megatron_dapo.policy.actor import MegatronActor
    from megatron_dapo.policy.batching import Sample

    base = _rss_mb()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    cfg = DAPOConfig(
        seed=0, num_threads=case.threads,
        model=ModelConfig(dtype="fp32", transformer_impl="local", recompute=case.recompute),
        parallel=ParallelConfig(),  # use_distributed_optimizer=True, the default
        data=DataConfig(prompts_per_step=1, gen_prompts_per_batch=1, max_prompt_length=case.prompt),
        rollout=RolloutConfig(temperature=TEMPERATURE, max_response_length=case.seq_len - case.prompt),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(enable=False)),
        train=TrainConfig(mini_batch_prompts=1, max_tokens_per_micro_batch=case.tokens),  # one micro-batch
        optim=OptimConfig(lr=LR, lr_warmup_steps=0, weight_decay=WEIGHT_DECAY, clip_grad=CLIP))
    actor = MegatronActor(cfg, _hf_config(case))
    actor.load_hf_weights(weights)
    ids, adv, old = _batch(case)
    samples = [Sample(prompt_ids=ids[i, :case.prompt], response_ids=ids[i, case.prompt:],
                      advantages=float(adv[i]), old_log_probs=old[i]) for i in range(case.seqs)]
    actor.prepare_for_training()

    def update():
        m = actor.get_loss_and_metrics(samples)
        return m["actor/pg_loss"], m["actor/grad_norm"]

    out = _timed_updates(case, update)
    out["peak_mb"] = _rss_mb("VmHWM") - base
    out["static_mb"] = _static_megatron(actor)
    if case.profile:
        out["profile"] = _profile_megatron(actor, update)
    destroy_parallel()
    return out


def _static_megatron(actor) -> dict:
    """MB of what lives across updates: parameters, the DDP gradient buffers, Adam states."""
    import torch

    params = sum(p.numel() * p.element_size() for c in actor.model for p in c.parameters())
    grads = sum(buf.grad_data.numel() * buf.grad_data.element_size()
                for c in actor.model for buf in c.buffers + c.expert_parallel_buffers)
    states = 0
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in opt.optimizer.state.values():
            states += sum(t.numel() * t.element_size() for t in state.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer_states": states / 2**20}


def _hf_side(case: Case, weights: str) -> dict:
    import torch
    import transformers
    from torch.profiler import record_function

    from megatron_dapo.algo import compute_policy_loss

    base = _rss_mb()
    model = transformers.Qwen2ForCausalLM.from_pretrained(weights, dtype=torch.float32)
    for p in model.parameters():  # own the memory (no file-backed pages of the safetensors mmap)
        p.data = p.data.clone()
    if case.recompute == "full":  # per-layer checkpoints, as megatron's "full" (uniform, 1 layer)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # megatron's rule: no weight decay on biases and 1-D parameters (the norms)
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8)
    ids, adv, old = _batch(case)
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # position t predicts t + 1
    span = slice(case.prompt - 1, case.seq_len - 1)  # positions whose label is a response token
    mask, old_full, adv_full = (torch.zeros(case.seqs, case.seq_len) for _ in range(3))
    mask[:, span], old_full[:, span] = 1.0, old
    adv_full[:, span] = adv[:, None]
    num_tokens = float(mask.sum())
    params = list(model.parameters())

    def update():  # labelled for the profile (record_function costs nothing without one)
        opt.zero_grad(set_to_none=True)
        with record_function("forward"):
            logits = model(input_ids=ids, use_cache=False).logits  # [B, S, V] fp32
        with record_function("logprobs_fwd"):
            logits.div_(TEMPERATURE)  # in place, as verl's actor does
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp.gather(-1, labels[..., None]).squeeze(-1)
            with torch.no_grad():  # the entropy metric megatron reports too, 256 positions at a time
                flat = logp.detach().view(-1, logp.shape[-1])
                ent = torch.cat([-(c.exp() * c).sum(-1) for c in flat.split(256)]).view_as(mask)
                entropy = (ent * mask).sum() / num_tokens
        loss, metrics = compute_policy_loss(lp, old_full, adv_full, mask, clip_ratio_low=0.2,
                                            clip_ratio_high=0.28, clip_ratio_c=10.0,
                                            global_num_tokens=num_tokens)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
            with record_function("adamw"):
                opt.step()
        entropy.item()  # the host sync megatron's metrics make
        return metrics["actor/pg_loss"].item(), float(norm)

    out = _timed_updates(case, update)
    if case.profile:
        out["profile"] = _profile(update)
    out["peak_mb"] = _rss_mb("VmHWM") - base
    static = sum(p.numel() * p.element_size() for p in params) / 2**20
    out["static_mb"] = {"params": static, "grads": static, "optimizer_states": 2 * static}
    return out


def _child(side: str, case: Case, weights: str) -> dict:
    import torch

    torch.set_num_threads(case.threads)
    out = _megatron_side(case, weights) if side == "megatron" else _hf_side(case, weights)
    out.update(side=side, threads=torch.get_num_threads())
    return out


# -- the profiles ------------------------------------------------------------------------------------------

_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_", "aten::linear",
               "aten::matmul"}
_LABELS = ("update", "forward", "logprobs_fwd", "backward", "logprobs_bwd", "finalize_grads", "optimizer",
           "adamw")


def _profile_megatron(actor, update) -> dict:
    """One more update under torch.profiler (with memory), labels hooked around the model forward,
    the log-prob function's forward and backward, the schedule's backward, the grad finalisation,
    megatron's optimizer step and the torch AdamW inside it. Time: each op's self time goes to its
    innermost label (matmuls apart). Memory: the tensors alive at the update's peak, by the label
    that allocated them."""
    from megatron.core.pipeline_parallel import schedules
    from torch.profiler import record_function

    from megatron_dapo.policy import logprobs

    def labelled(label, fn):
        def wrapper(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapper

    chunk = actor.model[0]
    fn_cls, config = logprobs._HiddenLogProbs, chunk.config
    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    patches = [(fn_cls, "forward", staticmethod(labelled("logprobs_fwd", fn_cls.forward))),
               (fn_cls, "backward", staticmethod(labelled("logprobs_bwd", fn_cls.backward))),
               (schedules, "backward_step", labelled("backward", schedules.backward_step)),
               (config, "finalize_model_grads_func",
                labelled("finalize_grads", config.finalize_model_grads_func)),
               (actor.optimizer, "step", labelled("optimizer", actor.optimizer.step)),
               (chunk, "forward", labelled("forward", chunk.forward))]
    patches += [(opt, "step", labelled("adamw", opt.step)) for opt in inner]
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        return _profile(update)
    finally:
        for obj, name, value in saved:
            if value is _MISSING:
                delattr(obj, name)  # an instance attribute hid the class's method
            else:
                setattr(obj, name, value)


def _profile(update) -> dict:
    """One update under torch.profiler (with memory): self time by label (_attribute_time) and by
    kind of op (_kind_time), the tensors alive at the peak by label (_attribute_memory)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        with record_function("update"):
            update()
        wall = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    events = prof.events()
    return dict(wall_s=wall, time_ms=_attribute_time(events), kind_ms=_kind_time(events),
                peak_mb=_attribute_memory(trace))


_MISSING = object()


def _attribute_time(events) -> dict[str, float]:
    """Self CPU ms of every op, summed per innermost label ('label:matmul' for matmul ops)."""
    out: dict[str, float] = {}
    for e in events:
        if e.name in _LABELS:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in _LABELS:
            parent = parent.cpu_parent
        label = parent.name if parent is not None else "unlabelled"
        if e.name in _MATMUL_OPS:
            label += ":matmul"
        out[label] = out.get(label, 0.0) + e.self_cpu_time_total / 1e3
    return out


def _kind_time(events) -> dict[str, float]:
    """Self CPU ms by kind of op: matrix products, the fused attention kernel (SDPA, forward and
    backward), everything else; the same split on both sides, whatever their labels."""
    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        if e.name in _LABELS:
            continue
        kind = ("matmul" if e.name in _MATMUL_OPS
                else "attention" if "flash_attention" in e.name or "scaled_dot_product" in e.name else "other")
        out[kind] += e.self_cpu_time_total / 1e3
    return out


def _attribute_memory(trace) -> dict[str, float]:
    """MB of the tensors allocated during the update and alive at its peak, by the innermost label
    whose span holds the allocation ('total' is their sum: the update's peak above what it started with)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"] in _LABELS)
    memory = sorted((e["ts"], e["args"]["Addr"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]")
    live: dict[int, tuple[int, float]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, float]] = {}
    for ts, addr, nbytes in memory:
        if nbytes > 0:
            live[addr] = (nbytes, ts)
        elif addr in live:
            live.pop(addr)
        else:
            continue  # freed, allocated before the profile
        total += nbytes
        if total > peak:
            peak, at_peak = total, dict(live)
    out: dict[str, float] = {"total": peak / 2**20}
    for nbytes, ts in at_peak.values():
        inside = [(b - a, name) for a, b, name in spans if a <= ts <= b]
        label = min(inside)[1] if inside else "unlabelled"
        out[label] = out.get(label, 0.0) + nbytes / 2**20
    return out


# -- the parent ---------------------------------------------------------------------------------------

def _spawn(args: list[str]) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, env=env)
    if proc.returncode:
        raise RuntimeError(f"{args[:2]} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(case: Case, rounds: int) -> dict:
    """Both sides from the same weights, alternating for ``rounds`` rounds (the profile, if asked
    for, in the last); best time, highest peak."""
    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as tmp:
        _spawn(["--make", json.dumps(dataclasses.asdict(case)), tmp])
        runs: dict[str, list[dict]] = {"hf": [], "megatron": []}
        for i in range(rounds):
            for side in ("hf", "megatron"):
                last = i == rounds - 1
                this = dataclasses.replace(case, profile=case.profile and last)
                runs[side].append(_spawn(["--child", side, json.dumps(dataclasses.asdict(this)), tmp]))
    out = {}
    for side, rs in runs.items():
        best = min(rs, key=lambda r: r["best_s"])
        out[side] = dict(best, peak_mb=max(r["peak_mb"] for r in rs),
                         all_seconds=[s for r in rs for s in r["seconds"]])
        out[side].update({k: v for r in rs for k, v in r.items() if k == "profile"})
    hf, mg = out["hf"], out["megatron"]
    out["loss_diff"] = max(abs(a - b) for a, b in zip(hf["losses"], mg["losses"]))
    out["grad_norm_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12)
                                    for a, b in zip(hf["grad_norms"], mg["grad_norms"]))
    # Same weights, tokens and optimizer: the same losses and norms, update after update. fp32 on
    # different kernels drifts a little, and the clipped Adam steps amplify it.
    assert out["loss_diff"] < 1e-3 and out["grad_norm_rel_diff"] < 1e-2, (
        hf["losses"], mg["losses"], hf["grad_norms"], mg["grad_norms"])
    return out


def _figures(name: str, result: dict, quick: bool) -> list[dict]:
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


def _cases(quick: bool, recompute: str, profile: bool, threads: int,
           only: tuple[str, ...] = tuple(VOCABS)) -> dict[str, Case]:
    layers, vocabs = (QUICK_LAYERS, QUICK_VOCABS) if quick else (LAYERS, VOCABS)
    vocabs = {k: v for k, v in vocabs.items() if k in only}
    seqs, seq_len, prompt, updates = (2, 256, 64, 1) if quick else (8, 512, 128, 3)
    return {f"V={v}" + ("" if recompute == "none" else f", recompute {recompute}"): Case(
        vocab=v, layers=layers, seqs=seqs, seq_len=seq_len, prompt=prompt, updates=updates,
        recompute=recompute, profile=profile, threads=threads) for v in vocabs.values()}


def _markdown(cases: dict[str, Case], results: dict[str, dict], quick: bool, rounds: int,
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


def run(quick: bool, *, recompute: str | None = None, profile: bool | None = None, rounds: int = 1,
        threads: int = 2, vocabs: tuple[str, ...] = tuple(VOCABS)) -> dict:
    """recompute None: no recompute at every vocabulary, and at full sizes also the small one with
    full recompute on both sides (where memory rather than the logits is the question);
    profile None: at full sizes."""
    profile = not quick if profile is None else profile
    cases = _cases(quick, recompute or "none", profile, threads, vocabs)
    if recompute is None and not quick and "small" in vocabs:
        cases.update(_cases(quick, "full", profile, threads, ("small",)))
    load_start = os.getloadavg()[0]
    results = {name: _measure(case, rounds) for name, case in cases.items()}
    figures = [f for name, r in results.items() for f in _figures(name, r, quick)]
    markdown = _markdown(cases, results, quick, rounds, (load_start, os.getloadavg()[0]))
    return {"name": "train_step", "figures": figures, "markdown": markdown, "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, < 1 min")
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="megatron's model.recompute; full also turns on HF's gradient checkpointing "
                        "(default: none, plus full at the small vocabulary at full sizes)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction,
                   help="a profile of one update of each side, megatron's in detail (default: at full sizes)")
    p.add_argument("--rounds", type=int, default=1, help="alternating runs of each side; best time is kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocabs", default=",".join(VOCABS),
                   help=f"comma-separated cases: {', '.join(f'{k} (V={v})' for k, v in VOCABS.items())}")
    p.add_argument("--json", help="also write the full result here")
    p.add_argument("--make", nargs=2, metavar=("CASE", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=3, metavar=("SIDE", "CASE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        _make_weights(Case(**json.loads(args.make[0])), args.make[1])
        print("{}")
        return
    if args.child:
        print(json.dumps(_child(args.child[0], Case(**json.loads(args.child[1])), args.child[2])))
        return
    vocabs = tuple(v.strip() for v in args.vocabs.split(",") if v.strip())
    if not vocabs or set(vocabs) - set(VOCABS):
        p.error(f"--vocabs {args.vocabs!r}: choose from {', '.join(VOCABS)}")
    result = run(args.quick, recompute=args.recompute, profile=args.profile, rounds=args.rounds,
                 threads=args.threads, vocabs=vocabs)
    print(result["markdown"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
