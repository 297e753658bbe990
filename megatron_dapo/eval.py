"""Evaluation: n samples per problem, scored with the reward fn, reported as avg@n, pass@k, cons@n.

DAPO's AIME protocol (reference dapo.md 1.4): the 30 problems, 32 samples each, temperature 1.0,
top-p 0.7, metric avg@32 (mean accuracy over the samples). The AIME file ships each problem 32
times; the loader merges the copies and ``eval.n`` draws the samples instead.
"""

from megatron_dapo.collect import generate_and_score
from megatron_dapo.eval_metrics import eval_metrics
from megatron_dapo.rollout.engine import RolloutEngine, SamplingParams


def evaluate(engine: RolloutEngine, prompt_ids: list[list[int]], ground_truths: list[str], *, tokenizer,
             params: SamplingParams, n: int, pool, prefix: str = "eval/") -> dict[str, float]:
    """Generates ``n`` responses per prompt and returns {prefix + avg@n (also as acc_mean), pass@1,
    pass@n, cons@n, response_length_mean, truncation_rate, num_timeouts}."""
    _, flat, results = generate_and_score(engine, prompt_ids, ground_truths, tokenizer=tokenizer, params=params,
                                          n=n, pool=pool)
    problems = [[(res["acc"], res["pred"]) for res in results[i * n:(i + 1) * n]] for i in range(len(prompt_ids))]
    summary, _ = eval_metrics(problems)
    out = {prefix + k: v for k, v in summary.items()}
    out[prefix + "acc_mean"] = summary[f"avg@{n}"]  # mean accuracy over all samples (avg@n)
    out[prefix + "response_length_mean"] = sum(len(r.response_ids) for r in flat) / len(flat)
    out[prefix + "truncation_rate"] = sum(r.finish_reason == "length" for r in flat) / len(flat)
    out[prefix + "num_timeouts"] = float(sum(r.get("timed_out", False) for r in results))
    return out
