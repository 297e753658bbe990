"""Peak memory and time of log-probs + DAPO loss + backward: ours vs the naive full-vocabulary path.

Paths, each on logits from a [T, H] x [H, V] projection (H small, so the [T, V] tensors dominate):
  naive   log_softmax(logits / temperature) over the full [T, V], then gather (baseline)
  logits  megatron_dapo.policy.vocab_parallel_logprobs on the logits (chunked, + entropy)
  fused   megatron_dapo.policy.logprobs.vocab_parallel_logprobs_from_hidden: the projection
          inside the chunk loop, so no [T, V] tensor exists (+ entropy)
then compute_policy_loss (token-mean, global_num_tokens) and backward to the hidden states and the
projection weight. TP=1, fp32, one CPU process per (path, T).

Peak memory is the process's peak RSS (ru_maxrss) minus its RSS once the inputs exist: the
logits, activations and gradients the path creates. Time is reported as wall and as process CPU
seconds (user + sys); ratios use CPU seconds, which other jobs on a shared machine disturb less.
Cases whose estimated peak exceeds --max-gb (default: half the available memory, at most 12 GB)
are skipped and reported as such; the estimate is (bytes of one fp32 [T, V]) x (3 naive,
2 logits) + 0.5 GB. The other paths' loss and gradient norm are asserted equal to the baseline's.

    python benchmarks/logprobs.py                       # V=152064, T = 4096 8192 16384
    python benchmarks/logprobs.py --tokens 1024 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PATHS = ("naive", "logits", "fused")
_ESTIMATE = {"naive": 3.0, "logits": 2.0, "fused": 0.0}  # x bytes of one fp32 [T, V]


def _case(path: str, tokens: int, vocab: int, hidden: int, temperature: float) -> dict:
    import psutil
    import torch

    from megatron_dapo.algo import compute_policy_loss
    from megatron_dapo.policy.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden

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


def _run_case(path, tokens, args) -> dict:
    cmd = [sys.executable, __file__, "--case", path, str(tokens), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--temperature", str(args.temperature)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return dict(error=(proc.stderr.strip().splitlines() or ["killed"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-gb", type=float, default=None)
    parser.add_argument("--case", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.vocab, args.hidden, args.temperature)))
        return

    import psutil
    budget = args.max_gb or min(12.0, psutil.virtual_memory().available / 2**30 / 2)
    print(f"vocab {args.vocab}, hidden {args.hidden}, temperature {args.temperature}, fp32, TP=1, "
          f"{os.cpu_count()} CPUs; memory budget {budget:.1f} GB per case")
    print(f"{'tokens':>7} {'path':>7} {'peak MB':>8} {'wall s':>7} {'cpu s':>7} {'mem/naive':>10} "
          f"{'cpu/naive':>10}  note")
    for tokens in args.tokens:
        one = tokens * args.vocab * 4 / 2**30
        results = {}
        for path in PATHS:
            estimate = one * _ESTIMATE[path] + 0.5
            if estimate > budget:
                results[path] = dict(skipped=f"skipped: estimated {estimate:.1f} GB > budget {budget:.1f} GB")
            else:
                results[path] = _run_case(path, tokens, args)
        naive = results["naive"]
        for path, r in results.items():
            if "peak_mb" not in r:
                print(f"{tokens:>7} {path:>7} {'-':>8} {'-':>7} {'-':>7} {'-':>10} {'-':>10}  "
                      f"{r.get('skipped') or r['error']}")
                continue
            mem = cpu = "-"
            if "peak_mb" in naive:
                mem, cpu = f"{r['peak_mb'] / naive['peak_mb']:.3f}x", f"{r['cpu'] / naive['cpu']:.2f}x"
                if path != "naive":  # same loss and gradients as the baseline
                    assert abs(r["loss"] - naive["loss"]) < 1e-4 * max(1, abs(naive["loss"])), (path, r)
                    assert abs(r["grad_norm"] - naive["grad_norm"]) < 1e-3 * naive["grad_norm"], (path, r)
            print(f"{tokens:>7} {path:>7} {r['peak_mb']:>8.0f} {r['seconds']:>7.2f} {r['cpu']:>7.2f} "
                  f"{mem:>10} {cpu:>10}  loss {r['loss']:.6f}")


if __name__ == "__main__":
    main()
