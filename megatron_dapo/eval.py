"""Evaluation: n samples per problem, scored, reported as avg@n, pass@n, cons@n.

DAPO's AIME protocol (docs/reference/dapo.md 1.4): the 30 problems, 32 samples each, temperature 1.0,
top-p 0.7, metric avg@32 (mean accuracy over the samples). The AIME file ships each problem 32
times; the loader always merges the copies and ``eval.n`` draws the samples instead.

Each response is scored twice: by ``reward_fn`` (eval.reward_fn, default the paper's rule, so
``eval/avg@32`` is the number to set beside the paper's) and by ``value_fn`` (our value scorer,
reported with the suffix ``_value``, e.g. ``eval/avg@32_value``). docs/reward.md explains
where the two disagree.

The problems are split over the rollout replicas like a generation batch (rollout/placement.py):
each replica's leader scores its share and sends back per-problem summaries (no token ids), so
every rank computes the same numbers, equal to a one-process evaluation with the same seed.
"""

import re

from megatron_dapo.groups import generate_scored
from megatron_dapo.eval_metrics import eval_metrics
from megatron_dapo.observe.audit import audit_group
from megatron_dapo.observe.rows import RowSpec, SampleRow, group_rows
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.placements import Placement


_INTEGER = re.compile(r"-?\d+")


def evaluate(placement: Placement, prompt_ids: list[list[int]], ground_truths: list[str], *, tokenizer,
             params: SamplingParams, n: int, pool, prefix: str = "eval/", reward_fn: str | None = None,
             value_fn: str | None = None) -> dict[str, float]:
    """Generates ``n`` responses per prompt and returns {prefix + avg@n (the mean accuracy over all n),
    pass@n, cons@n, format_rate (the scorer read an integer answer), response_length_mean,
    truncation_rate, num_timeouts}, on every rank, scored by
    the pool's fn ``reward_fn`` (None: its default). With ``value_fn``, also avg@n, pass@n and
    cons@n scored by that fn, each key with the suffix "_value", and scorer_disagreement (the
    fraction of responses the two judge differently)."""
    return evaluate_with_rows(placement, prompt_ids, ground_truths, tokenizer=tokenizer, params=params, n=n, pool=pool,
                              prefix=prefix, reward_fn=reward_fn, value_fn=value_fn)[0]


def evaluate_with_rows(placement: Placement, prompt_ids: list[list[int]], ground_truths: list[str], *,
                       tokenizer, params: SamplingParams, n: int, pool, prefix: str = "eval/",
                       reward_fn: str | None = None, value_fn: str | None = None,
                       rows: RowSpec | None = None) -> tuple[dict[str, float], list[SampleRow]]:
    """``evaluate``, and the dump rows (observe/rows.py) of the problems at positions below
    ``rows.dump_groups`` (none without ``rows``)."""
    fns = (reward_fn,) if value_fn is None else (reward_fn, value_fn)

    def summarise(p: int, rollouts: list, scored: list[list[dict]], texts: list[str]) -> dict:
        acc = [r["acc"] for r in scored[0]]
        audit, flags = audit_group(texts, acc, [r["acc"] for r in scored[1]] if len(scored) > 1 else None)
        made = []
        if rows is not None and p < rows.dump_groups:
            prompt = tokenizer.batch_decode([rollouts[0].prompt_ids], skip_special_tokens=True)[0]
            made = group_rows(rows, prompt_index=p, position=p, prompt=prompt, texts=texts, rollouts=rollouts,
                              ground_truth=ground_truths[p], results=scored[0],
                              audit_results=scored[1] if len(scored) > 1 else None, flags=flags)
        return {"samples": [[(r["acc"], r["pred"]) for r in results] for results in scored],
                "lengths": [len(r.response_ids) for r in rollouts],
                "truncated": sum(r.finish_reason == "length" for r in rollouts),
                "timeouts": sum(r.get("timed_out", False) for results in scored for r in results),
                "disagree": audit.disagree, "rows": made}

    problems = generate_scored(placement, prompt_ids, n, params, ground_truths=ground_truths, tokenizer=tokenizer,
                               pool=pool, fns=fns, summarise=summarise)
    out = {}
    for k, suffix in enumerate(("", "_value")[:len(fns)]):
        summary, _ = eval_metrics([p["samples"][k] for p in problems])
        out |= {prefix + key + suffix: v for key, v in summary.items()}
    num_responses = sum(len(p["lengths"]) for p in problems)
    preds = [pred for p in problems for _, pred in p["samples"][0]]
    out[prefix + "format_rate"] = sum(bool(_INTEGER.fullmatch(pred)) for pred in preds) / num_responses
    out[prefix + "response_length_mean"] = sum(sum(p["lengths"]) for p in problems) / num_responses
    out[prefix + "truncation_rate"] = sum(p["truncated"] for p in problems) / num_responses
    out[prefix + "num_timeouts"] = float(sum(p["timeouts"] for p in problems))
    if len(fns) > 1:
        out[prefix + "scorer_disagreement"] = sum(p["disagree"] for p in problems) / num_responses
    return out, [r for p in problems for r in p["rows"]]
