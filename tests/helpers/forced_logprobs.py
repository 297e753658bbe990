"""How far an engine's rollouts' log-probs are from a transformers model teacher-forced on them."""

from megatron_dapo.rollout import score_logprobs


def max_logprob_diff(model, rollouts, temperature: float = 1.0) -> float:
    """The largest |engine log-prob - the model's| over every response token of ``rollouts``."""
    forced = score_logprobs(model, [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], temperature)
    return max(abs(a - b) for r, f in zip(rollouts, forced) for a, b in zip(r.logprobs, f, strict=True))
