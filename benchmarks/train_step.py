"""One DAPO update on CPU: MegatronActor (Megatron-Core) vs HF transformers doing the same work.

Both sides start from the same Qwen2 weights (GQA, QKV bias, RMSNorm, SwiGLU, RoPE, untied
embeddings; fp32) and update on the same mini-batch: ``seqs`` random sequences of ``seq_len``
tokens, the last ``seq_len - prompt`` of each a response, per-sequence advantages, old log-probs
near the untrained model's. One update is, on both sides:

  megatron  MegatronActor.get_loss_and_metrics in a world of one (gloo), one micro-batch, local
            spec (attention: torch SDPA, mcore/sdpa_attention.py): the
            chunked log-prob path with the output projection fused in (mcore/logprobs.py; its
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
updates hold. Targets: tokens/s
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
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# benchmarks/ is no package: its directory on the path lets the sibling modules import whether this
# runs as a script, as its own child process or loaded by path (run_all, the tests)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _train_step_report as report  # noqa: E402
from _train_step_cases import VOCABS, Case, child, make_cases, make_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


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


def run(quick: bool, *, recompute: str | None = None, profile: bool | None = None, rounds: int = 1,
        threads: int = 2, vocabs: tuple[str, ...] = tuple(VOCABS)) -> dict:
    """recompute None: no recompute at every vocabulary, and at full sizes also the small one with
    full recompute on both sides (where memory rather than the logits is the question);
    profile None: at full sizes."""
    profile = not quick if profile is None else profile
    cases = make_cases(quick, recompute or "none", profile, threads, vocabs)
    if recompute is None and not quick and "small" in vocabs:
        cases.update(make_cases(quick, "full", profile, threads, ("small",)))
    load_start = os.getloadavg()[0]
    results = {name: _measure(case, rounds) for name, case in cases.items()}
    figures = [f for name, r in results.items() for f in report.figures(name, r, quick)]
    markdown = report.render_markdown(cases, results, quick, rounds, (load_start, os.getloadavg()[0]))
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
        make_weights(Case(**json.loads(args.make[0])), args.make[1])
        print("{}")
        return
    if args.child:
        print(json.dumps(child(args.child[0], Case(**json.loads(args.child[1])), args.child[2])))
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
