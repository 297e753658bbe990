"""Evaluation metrics over n sampled responses per problem: avg@k, pass@k, cons@k.

The DAPO paper reports AIME-2024 avg@32 (Fig. 1 also pass@32 and cons@32): 32 samples per
problem at temperature 1.0, top-p 0.7 (docs/reference/dapo.md 1.4). Each sample is scored by the reward
function into (acc, pred): correctness and the extracted answer string. A run logs the paper's three
at k = n (``eval_metrics``' default): avg@n is verl's mean@n and the unbiased pass@1, cons@n verl's
maj@n (docs/reward.md, "What the evaluation numbers mean").

- avg@k: mean accuracy of the first k samples (avg@n is "pass@1 averaged over n samples",
  DAPO#5).
- pass@k: probability that at least one of k samples drawn without replacement from the n is
  correct, the unbiased estimator 1 - C(n - c, k) / C(n, k) of Chen et al. 2021 (arXiv
  2107.03374, Codex, eq. 1), c = number correct; at k = n it is 1 if any sample is correct.
- cons@k: majority vote over the first k samples' preds, scored by the winning pred's
  correctness. Ties go to the pred that appears first among the samples (as verl's
  calc_maj_val, which takes the first maximum of an insertion-ordered dict). An empty pred (no
  answer extracted) takes part in the vote like any other, but if it wins the problem counts as
  wrong, whatever its acc says.

Pure Python: no torch, cheap to import from the eval CLI.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

Sample = tuple[bool, str]  # (acc, pred) of one response


def avg_at_k(accs: Sequence[bool], k: int | None = None) -> float:
    """Mean accuracy of the first k samples (all of them when k is None)."""
    k = _check_k(len(accs), k)
    return sum(bool(a) for a in accs[:k]) / k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k / i), which avoids huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    _check_k(n, k)
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def cons_at_k(samples: Sequence[Sample], k: int | None = None) -> float:
    """1.0 if the majority pred of the first k samples is correct (and non-empty), else 0.0."""
    k = _check_k(len(samples), k)
    first = samples[:k]
    votes = Counter(pred for _, pred in first)  # Counter keeps first-insertion order
    winner = max(votes, key=votes.__getitem__)  # max returns the first of equal maxima
    if winner == "":
        return 0.0
    acc = next(a for a, pred in first if pred == winner)
    return 1.0 if acc else 0.0


@dataclass(frozen=True)
class ProblemMetrics:
    """Metrics of one problem: num_samples, num_correct, and the per-k values."""

    num_samples: int
    num_correct: int
    avg: dict[int, float]
    pass_at: dict[int, float]
    cons: dict[int, float]


def problem_metrics(samples: Sequence[Sample], ks: Sequence[int]) -> ProblemMetrics:
    """avg@k (first k), pass@k (unbiased, all n), cons@k (first k) for each k in ks."""
    n = len(samples)
    c = sum(bool(a) for a, _ in samples)
    accs = [bool(a) for a, _ in samples]
    return ProblemMetrics(
        num_samples=n, num_correct=c,
        avg={k: avg_at_k(accs, k) for k in ks},
        pass_at={k: pass_at_k(n, c, k) for k in ks},
        cons={k: cons_at_k(samples, k) for k in ks})


def eval_metrics(problems: Sequence[Sequence[Sample]], ks: Sequence[int] | None = None
                 ) -> tuple[dict[str, float], list[ProblemMetrics]]:
    """Per-problem metrics and their means over problems.

    Args:
        problems: one list of (acc, pred) per problem; every problem needs the same number n of
            samples (the "@n" in the names would be meaningless otherwise).
        ks: the k values to report; None = (n,): every number over all n samples (avg@1 would be
            the first sample alone, pass@1 the same value as avg@n).

    Returns:
        ({"avg@k": .., "pass@k": .., "cons@k": .. for each k}, [ProblemMetrics per problem]).
    """
    if not problems:
        raise ValueError("no problems to evaluate")
    sizes = sorted({len(p) for p in problems})
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got sizes {sizes}")
    n = sizes[0]
    ks = sorted(set(ks)) if ks is not None else [n]
    per_problem = [problem_metrics(p, ks) for p in problems]
    summary: dict[str, float] = {}
    for k in ks:
        summary[f"avg@{k}"] = sum(m.avg[k] for m in per_problem) / len(per_problem)
        summary[f"pass@{k}"] = sum(m.pass_at[k] for m in per_problem) / len(per_problem)
        summary[f"cons@{k}"] = sum(m.cons[k] for m in per_problem) / len(per_problem)
    return summary, per_problem


def _check_k(n: int, k: int | None) -> int:
    if n < 1:
        raise ValueError("need at least one sample")
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    return k
