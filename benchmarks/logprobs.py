"""Peak memory and time of log-probs + DAPO loss + backward: ours vs the naive full-vocabulary path.

Paths, each on logits from a [T, H] x [H, V] projection (H small, so the [T, V] tensors dominate):
  naive   log_softmax(logits / temperature) over the full [T, V], then gather (baseline)
  logits  megatron_dapo.mcore.vocab_parallel_logprobs on the logits (chunked, + entropy)
  fused   megatron_dapo.mcore.logprobs.vocab_parallel_logprobs_from_hidden: the projection
          inside the chunk loop, so no [tokens, V] tensor exists (+ entropy)
then compute_policy_loss (token-mean, global_num_tokens) and backward to the hidden states and the
projection weight. TP=1, fp32, one CPU process per (path, T), so no two peaks mix.

Peak memory is the process's peak RSS (ru_maxrss) minus its RSS once the inputs exist: the
logits, activations and gradients the path creates. Time is reported as process CPU seconds
(user + sys), which other jobs on a shared machine disturb less than wall time.

Cells too big for this machine are modelled, not skipped. The naive and logits paths hold a fixed
number of [T, V] fp32 tensors at their peak, so their peak is linear in T x V:
    peak MB = copies x (MB of one fp32 [T, V]) + intercept,
fitted by least squares on measured runs at the same vocabulary and fewer tokens only (--fit-tokens;
more than one chunk of the chunked paths, so the same code runs). Every cell that fits the memory
budget (--max-gb; default half the available memory, at most 12 GB) is also measured, and the
model's error there is reported: those cells validate the model. The fused path is always measured.
A modelled cell's CPU time is a line through all measured runs of its path (fit runs and measured
cells; its largest residual is reported): CPU time on a shared machine is too noisy to extrapolate
from the small runs alone. The measured paths' losses and gradient norms are asserted equal at every T.

    python benchmarks/logprobs.py                       # V=152064, T = 2048 ... 16384: 4-7 min on 2 cores
    python benchmarks/logprobs.py --tokens 1024 --vocab 32000 --fit-tokens 600 800
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

PATHS = ("naive", "logits", "fused")
MODELLED = ("naive", "logits")  # the paths whose peak grows with T x V
LOAD_ALLOWANCE_GB = 0.5  # imports and inputs, on top of the modelled peak, for the budget check
MODEL_ERROR_TARGET = 0.05  # a model that misses a measured cell by more is not to be trusted
FUSED_GROWTH_TARGET = 1.25  # DESIGN.md numerics contract: the fused peak does not scale with T x V
HIDDEN, TEMPERATURE = 64, 0.7  # H small: the [T, V] tensors dominate; temperature != 1: the division runs
# The fits start above DEFAULT_CHUNK_TOKENS (mcore/logprobs.py, 256): up to it the chunk buffers
# shrink with T, above it they are constant, so a fit through both regimes bends the line (fitted
# on 256-1024 with 256-token chunks, the logits path model missed 8192 tokens by 12.5%).
FULL = dict(tokens=(2048, 4096, 8192, 16384), fit_tokens=(512, 768, 1024), vocab=152064, max_gb=None)
QUICK = dict(tokens=(512, 1024, 2048), fit_tokens=(320, 448), vocab=152064, max_gb=2.5)


def _case(path: str, tokens: int, vocab: int, hidden: int, temperature: float) -> dict:
    import psutil
    import torch

    from megatron_dapo.algo import compute_policy_loss
    from megatron_dapo.mcore.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden

    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).requires_grad_()
    target = torch.randint(0, vocab, (1, tokens), generator=g)
    adv, mask = torch.randn(1, generator=g), torch.ones(1, tokens)
    noise = 0.1 * torch.randn(1, tokens, generator=g)
    base = psutil.Process().memory_info().rss

    start, cpu_start = time.perf_counter(), _cpu_seconds()
    if path == "naive":
        logp_all = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
        lp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    elif path == "logits":
        lp, _ = vocab_parallel_logprobs(h @ w.t(), target, temperature=temperature)
    else:
        lp, _ = vocab_parallel_logprobs_from_hidden(h, w, target, temperature=temperature)
    loss, _ = compute_policy_loss(lp, (lp.detach() + noise), adv, mask, clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, global_num_tokens=tokens)
    loss.backward()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return dict(peak_mb=max(0, peak - base) / 2**20, seconds=seconds, cpu=cpu, loss=loss.item(),
                grad_norm=float(torch.cat([h.grad.flatten(), w.grad.flatten()]).norm()))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_case(path: str, tokens: int, vocab: int, hidden: int, temperature: float) -> dict:
    cmd = [sys.executable, __file__, "--case", path, str(tokens), "--vocab", str(vocab),
           "--hidden", str(hidden), "--temperature", str(temperature)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"case {path} T={tokens} failed (exit {proc.returncode}): "
                           f"{(proc.stderr.strip().splitlines() or ['killed'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys against xs."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    return slope, my - slope * mx


def measure(tokens, fit_tokens, vocab: int, hidden: int, temperature: float, budget_gb: float,
            progress=print) -> dict:
    """Fit the peak models, then fill every (path, T) cell: measured where it fits the budget, else
    modelled; measured naive/logits cells also carry the peak model's prediction and error."""
    one_mb = {t: t * vocab * 4 / 2**20 for t in set(tokens) | set(fit_tokens)}  # one fp32 [T, V]
    models = {}
    for path in MODELLED:
        runs = {t: _run_case(path, t, vocab, hidden, temperature) for t in fit_tokens}
        copies, peak0 = fit_line([one_mb[t] for t in fit_tokens], [runs[t]["peak_mb"] for t in fit_tokens])
        models[path] = dict(copies=copies, intercept_mb=peak0,
                            fit={t: {k: runs[t][k] for k in ("peak_mb", "cpu")} for t in fit_tokens})
        progress(f"  model {path}: peak = {copies:.3f} x [T, V] + {peak0:.0f} MB "
                 f"(fitted at T = {', '.join(map(str, fit_tokens))})")
    cells = {}
    for t in tokens:
        cells[t] = {}
        for path in PATHS:
            model = models.get(path)
            predicted = model and model["copies"] * one_mb[t] + model["intercept_mb"]
            if predicted and predicted / 1024 + LOAD_ALLOWANCE_GB > budget_gb:
                cells[t][path] = dict(source="modelled", peak_mb=predicted)
            else:
                cell = dict(source="measured", **_run_case(path, t, vocab, hidden, temperature))
                if predicted:
                    cell.update(model_peak_mb=predicted, peak_error=predicted / cell["peak_mb"] - 1)
                cells[t][path] = cell
            c = cells[t][path]
            cpu = f", {c['cpu']:.2f} CPU s" if "cpu" in c else ""
            progress(f"  T={t:>6} {path:>6}: {c['peak_mb']:>9.0f} MB{cpu} ({c['source']})")
        _check_equal(t, cells[t])
    for path, model in models.items():  # CPU time of the modelled cells: see _fit_time
        _fit_time(model, [(t, row[path]) for t, row in cells.items()])
    return dict(tokens=list(tokens), fit_tokens=list(fit_tokens), vocab=vocab, hidden=hidden,
                temperature=temperature, budget_gb=budget_gb, models=models, cells=cells)


def _fit_time(model: dict, cells: list[tuple[int, dict]]) -> None:
    """CPU s = rate x T + intercept by least squares over every measured run of the path (the fit
    runs and the measured cells): on a shared machine CPU time is too noisy to extrapolate from the
    small fit runs alone. Sets the modelled cells' "cpu" and the measured cells' residual."""
    points = [(t, r["cpu"]) for t, r in model["fit"].items()]
    points += [(t, c["cpu"]) for t, c in cells if c["source"] == "measured"]
    rate, cpu0 = fit_line([t for t, _ in points], [y for _, y in points])
    model.update(cpu_per_token=rate, cpu_intercept=cpu0)
    for t, c in cells:
        if c["source"] == "modelled":
            c["cpu"] = rate * t + cpu0
        else:
            c["cpu_residual"] = (rate * t + cpu0) / c["cpu"] - 1


def _check_equal(tokens: int, row: dict) -> None:
    measured = [(p, c) for p, c in row.items() if c["source"] == "measured"]
    for path, c in measured[1:]:  # same loss and gradients as the first measured path
        ref = measured[0][1]
        assert abs(c["loss"] - ref["loss"]) < 1e-4 * max(1, abs(ref["loss"])), (tokens, path, c, ref)
        assert abs(c["grad_norm"] - ref["grad_norm"]) < 1e-3 * ref["grad_norm"], (tokens, path, c, ref)


def _max_error(result: dict, path: str, key: str) -> float | None:
    errors = [abs(row[path][key]) for row in result["cells"].values() if key in row[path]]
    return max(errors) if errors else None


def _cell_text(c: dict, naive: dict | None) -> str:
    ratio = f" ({c['peak_mb'] / naive['peak_mb']:.3g}x)" if naive else ""
    if c["source"] == "modelled":
        return f"{c['peak_mb']:,.0f}{ratio} modelled"
    check = f"; model {c['model_peak_mb']:,.0f}, {c['peak_error']:+.2%}" if "model_peak_mb" in c else ""
    return f"{c['peak_mb']:,.0f}{ratio} measured{check}"


def render_markdown(result: dict) -> str:
    head = ("| tokens | naive peak MB | logits path MB (vs naive) | fused path MB (vs naive) "
            "| fused CPU time vs naive |\n|---|---|---|---|---|")
    lines = [head]
    for t, row in result["cells"].items():
        n, f = row["naive"], row["fused"]
        time_ratio = (f"{f['cpu'] / n['cpu']:.2f}x ({f['cpu']:.1f} s / {n['cpu']:.1f} s"
                      + (" modelled)" if n["source"] == "modelled" else ")"))
        lines.append(f"| {t} | {_cell_text(n, None)} | {_cell_text(row['logits'], n)} "
                     f"| {_cell_text(f, n)} | {time_ratio} |")
    models = []
    for path, m in result["models"].items():
        peak_err, cpu_err = _max_error(result, path, "peak_error"), _max_error(result, path, "cpu_residual")
        peak = f"{m['copies']:.3f} x MB of one fp32 [T, V] {_signed(m['intercept_mb'], 0)}"
        cpu = f"{m['cpu_per_token'] * 1000:.3f} ms x T {_signed(m['cpu_intercept'], 2)}"
        models.append(f"{path}: peak MB = {peak}, largest error at the measured cells {_pct(peak_err)}; "
                      f"CPU s = {cpu} (least squares over all its measured runs; largest residual at the "
                      f"measured cells {_pct(cpu_err)})")
    return "\n".join(lines) + (
        f"\n\nV = {result['vocab']}, hidden {result['hidden']}, temperature {result['temperature']}, fp32, "
        f"TP=1, each cell its own process; memory budget {result['budget_gb']:.1f} GB per case. "
        f"\"modelled\" cells exceed the budget. Their peaks come from least-squares lines fitted on "
        f"measured runs at the same V and T = {', '.join(map(str, result['fit_tokens']))} only, checked "
        f"against every measured cell (error = model / measured - 1, shown beside the cell). CPU time "
        f"on a shared machine is too noisy for that, so the naive time of a modelled row is a line "
        f"through all measured runs of the path:\n"
        + "\n".join(f"- {m}" for m in models) + "\n")


def _signed(x: float, digits: int) -> str:
    return f"{'-' if x < 0 else '+'} {abs(x):.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def figures(result: dict) -> list[dict]:
    out = []

    def add(figure, value, unit, base_name=None, base=None, target=None, met=None):
        out.append(dict(figure=figure, value=value, unit=unit, baseline_name=base_name, baseline=base,
                        ratio=None if base is None else value / base, target=target, met=met))

    for t, row in result["cells"].items():
        n = row["naive"]
        add(f"naive path peak, {t} tokens ({n['source']})", n["peak_mb"], "MB")
        for path in ("logits", "fused"):
            c = row[path]
            add(f"{path} path peak, {t} tokens ({c['source']})", c["peak_mb"], "MB",
                f"naive ({n['source']})", n["peak_mb"])
        add(f"fused path CPU time, {t} tokens", row["fused"]["cpu"], "s", f"naive ({n['source']})", n["cpu"])
    for path in MODELLED:
        err = _max_error(result, path, "peak_error")
        if err is not None:
            add(f"{path} peak model, largest error at the measured cells", 100 * err, "%",
                target=f"<= {MODEL_ERROR_TARGET:.0%}", met=err <= MODEL_ERROR_TARGET)
    fused = [row["fused"]["peak_mb"] for row in result["cells"].values()]
    ts = list(result["cells"])
    add(f"fused path peak, {ts[-1]} vs {ts[0]} tokens", fused[-1], "MB", f"fused at {ts[0]} tokens", fused[0],
        target=f"<= {FUSED_GROWTH_TARGET}x (peak does not scale with T x V)",
        met=fused[-1] <= FUSED_GROWTH_TARGET * fused[0])
    return out


def default_budget_gb() -> float:
    import psutil
    return min(12.0, psutil.virtual_memory().available / 2**30 / 2)


def run(quick: bool) -> dict:
    """benchmarks/run_all.py entry: QUICK (T up to 2048, under a minute) or FULL (T up to 16384,
    4-7 min on 2 cores)."""
    size = QUICK if quick else FULL
    result = measure(size["tokens"], size["fit_tokens"], size["vocab"], HIDDEN, TEMPERATURE,
                     size["max_gb"] or default_budget_gb())
    return dict(name="logprobs", figures=figures(result), markdown=render_markdown(result), details=result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(FULL["tokens"]))
    parser.add_argument("--fit-tokens", type=int, nargs="+", default=list(FULL["fit_tokens"]),
                        help="token counts of the runs the naive/logits models are fitted on")
    parser.add_argument("--vocab", type=int, default=FULL["vocab"])
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--temperature", type=float, default=TEMPERATURE)
    parser.add_argument("--max-gb", type=float, default=None, help="cells above it are modelled")
    parser.add_argument("--json", help="also write the raw result here")
    parser.add_argument("--case", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.vocab, args.hidden, args.temperature)))
        return
    result = measure(args.tokens, args.fit_tokens, args.vocab, args.hidden, args.temperature,
                     args.max_gb or default_budget_gb())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(render_markdown(result))


if __name__ == "__main__":
    main()
