"""``peer_trl.py --profile``: where each side's seconds go, by phase and by op, at the demo size and at
a larger toy (4 layers, hidden 256, 64-token response limit). One run per side under cProfile (its
overhead inflates Python-heavy code, so read the shares, not the totals); self time is folded into
kinds of work, and the largest entries are listed."""

from __future__ import annotations

import dataclasses
import pstats
from pathlib import Path

LARGER = ("toy.num_layers=4", "toy.hidden_size=256", "toy.intermediate_size=768")
# (kind, substrings of a cProfile entry's name): the first kind that matches takes the entry's self time
KINDS = (
    ("matmul / linear", ("linear", "matmul", "'mm'", "addmm", "bmm", "baddbmm")),
    ("attention", ("scaled_dot_product_attention",)),
    ("autograd backward (C++)", ("run_backward",)),
    ("optimizer", ("adam", "optimizer.py", "clip_grads")),
    ("sampling (exponential race, softmax)", ("exponential_", "softmax", "sort", "topk")),
    ("waiting on the reward worker", ("poll", "connection.py", "wait'")),
    ("other torch ops", ("torch._c", "tensorbase", "built-in method torch")),
)


def _name(func: tuple) -> str:
    path, line, name = func
    return f"{name}" if path == "~" else f"{Path(path).name}:{line}({name})"


def summarise_profile(path: Path, top: int = 10) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(self seconds by kind, the ``top`` entries by self time) of one cProfile dump."""
    stats = pstats.Stats(str(path)).stats
    kinds: dict[str, float] = {k: 0.0 for k, _ in KINDS} | {"Python (everything else)": 0.0}
    entries = []
    for func, (_, _, tottime, _, _) in stats.items():
        name = _name(func)
        kind = next((k for k, keys in KINDS if any(key in name.lower() for key in keys)), "Python (everything else)")
        kinds[kind] += tottime
        entries.append((name, tottime))
    return kinds, sorted(entries, key=lambda e: -e[1])[:top]


def profile(settings, work: Path, run_ours, run_trl, prepare) -> str:
    """Markdown: each side's profile at the demo size and at LARGER, seed 1, 20 steps."""
    md = ["### Profile (cProfile, seed 1, 20 steps, one process)", ""]
    for label, toy, tokens in (("demo size", (), settings.max_tokens),
                               ("larger toy: " + ", ".join(LARGER), LARGER, 64)):
        s = dataclasses.replace(settings, steps=20, seeds=(1,), dp2=False, toy=toy, max_tokens=tokens)
        inputs = prepare(work, 1, toy)
        tables, phases = {}, ""
        for side, fn in (("ours", run_ours), ("trl", run_trl)):
            dump = work / f"{side}_{len(toy)}.prof"
            result = fn(s, 1, inputs, work, f"profile_{side}_{len(toy)}", env={"PEER_PROFILE": str(dump)})
            tables[side] = summarise_profile(dump)
            if side == "ours":
                phases = ", ".join(f"{k} {v:.2f} s" for k, v in result["phases"].items())
            else:
                phases += f"; TRL's generation + scoring + old log-probs {sum(result['generate_seconds']):.2f} s"
        md += [f"**{label}.** Phases (under the profiler): {phases}.", "",
               "| self time by kind (s) | megatron-dapo | TRL |", "|---|---|---|"]
        for kind in tables["ours"][0]:
            md.append(f"| {kind} | {tables['ours'][0][kind]:.2f} | {tables['trl'][0][kind]:.2f} |")
        md += ["", "Largest entries by self time: ours " + "; ".join(f"`{n}` {t:.2f} s" for n, t in tables["ours"][1])
               + ". TRL " + "; ".join(f"`{n}` {t:.2f} s" for n, t in tables["trl"][1]) + ".", ""]
    return "\n".join(md)
