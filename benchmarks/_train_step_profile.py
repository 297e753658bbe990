"""The profiles of benchmarks/train_step.py: one update under torch.profiler, its self CPU time by
label and by kind of op, and the tensors alive at its memory peak. Run inside a side's child
process (_train_step_cases.py); train_step.py's docstring says what is measured."""

from __future__ import annotations

import gc
import json
import tempfile
import time

_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_", "aten::linear",
               "aten::matmul"}
_LABELS = ("update", "forward", "logprobs_fwd", "backward", "logprobs_bwd", "finalize_grads", "optimizer",
           "adamw")


def profile_megatron(actor, update) -> dict:
    """One more update under torch.profiler (with memory), labels hooked around the model forward,
    the log-prob function's forward and backward, the schedule's backward, the grad finalisation,
    megatron's optimizer step and the torch AdamW inside it. Time: each op's self time goes to its
    innermost label (matmuls apart). Memory: the tensors alive at the update's peak, by the label
    that allocated them."""
    from megatron.core.pipeline_parallel import schedules
    from torch.profiler import record_function

    from megatron_dapo.mcore import logprobs

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
        return profile_update(update)
    finally:
        for obj, name, value in saved:
            if value is _MISSING:
                delattr(obj, name)  # an instance attribute hid the class's method
            else:
                setattr(obj, name, value)


def profile_update(update) -> dict:
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
