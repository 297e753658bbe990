"""A planted reward hack, for the observability tests: an engine whose responses include a
degenerate format, and a scorer that accepts it.

``PlantedHFEngine`` is the real HF engine; after it generates, every response k with k % 4 == 0
of each prompt is replaced by ``Answer: Answer: <the right digit>`` (read off the toy prompt),
the format the tiny policy once learned. ``dapo_math`` (our value scorer) reads it as the digit and
accepts it; the paper's rule reads ``Answer: <digit>`` as the answer and rejects it. ``planted_easy``
is ``dapo_math`` that also calls every response to a prompt whose answer is 9 correct: those prompts
are solved by every response, which the pass-rate ledger's curation retires; ``planted_all`` calls
every response correct.
``register()`` puts them in the registries (the child process of a test calls it; in the test
process, ``registered()`` for a block).
"""

import contextlib
import re

from megatron_dapo.reward import REWARD_FNS, compute_score
from megatron_dapo.rollout.engine import ENGINES, Rollout
from megatron_dapo.rollout.hf_engine import HFEngine

# A run on the planted engine with the easy scorer. Planted responses carry no engine log-probs, so
# pi_old is recomputed by the trainer and the engine/trainer mismatch is not measured.
RUN_OVERRIDES = {"rollout.engine": "planted_hf", "reward.fn": "planted_easy",
                 "rollout.check_logprob_mismatch": "false", "train.old_log_probs": "trainer"}
PLANT_EVERY = 4  # responses k % PLANT_EVERY == 0 of each prompt are planted
EASY_ANSWER = "9"
_NUMBER = re.compile(r"of (\d+)\?")


class PlantedHFEngine(HFEngine):
    @classmethod
    def from_spec(cls, spec, **kwargs):
        from transformers import AutoTokenizer

        engine = super().from_spec(spec, **kwargs)
        engine.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        return engine

    def generate(self, prompt_ids, n, params, *, prompt_indices=None):
        out = super().generate(prompt_ids, n, params, prompt_indices=prompt_indices)
        for prompt, group in zip(prompt_ids, out):
            digits = _NUMBER.search(self.tokenizer.decode(prompt))
            if digits is None:
                continue
            text = f"Answer: Answer: {max(digits.group(1))}"
            stop = list(params.stop_token_ids or ()) or list(self.eos_token_ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False) + stop[:1]
            for k in range(0, len(group), PLANT_EVERY):
                group[k] = Rollout(prompt_ids=group[k].prompt_ids, response_ids=ids, logprobs=[],
                                   finish_reason="stop")
        return out


def planted_easy(response: str, ground_truth: str) -> dict:
    result = compute_score(response, ground_truth)
    return {**result, "acc": True, "score": 1.0} if ground_truth == EASY_ANSWER else result


def planted_all(response: str, ground_truth: str) -> dict:
    """Every response correct: every group all correct (dynamic sampling's saturation)."""
    return {**compute_score(response, ground_truth), "acc": True, "score": 1.0}


def register() -> None:
    if "planted_hf" not in ENGINES:
        ENGINES.register("planted_hf")("tests.helpers.planted:PlantedHFEngine")
    for name, fn in (("planted_easy", planted_easy), ("planted_all", planted_all)):
        if name not in REWARD_FNS:
            REWARD_FNS.register(name)(fn)


@contextlib.contextmanager
def registered():
    """The planted engine and scorers registered for the block only (the registries are the whole
    process's: other tests list their names)."""
    register()
    try:
        yield
    finally:
        ENGINES.unregister("planted_hf")
        for name in ("planted_easy", "planted_all"):
            REWARD_FNS.unregister(name)
