"""benchmarks/reward_fuzz.py at a small size: adversarial inputs raise nothing, and no input that is
wrong by construction scores correct (the full-size run is `python benchmarks/reward_fuzz.py`)."""

import importlib.util
from pathlib import Path

import pytest

_HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "reward_fuzz.py"
_spec = importlib.util.spec_from_file_location("reward_fuzz", _HARNESS)
reward_fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reward_fuzz)


def test_generator_is_deterministic_and_mixed():
    cases = reward_fuzz.generate(300, seed=5)
    assert cases == reward_fuzz.generate(300, seed=5) != reward_fuzz.generate(300, seed=6)
    assert {c.expect for c in cases} == {True, False, None}
    kinds = {"hedged", "other_value", "list", "huge", "unicode", "earlier_answer", "random", "control"}
    assert {c.kind for c in cases} == kinds
    assert max(len(c.response) for c in reward_fuzz.generate(300, seed=0)) > 20_000


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_no_exception_and_no_false_positive(seed):
    # Only seed 0 goes through a RewardPool too (one worker): pool start-up is the slow part.
    report = reward_fuzz.check(reward_fuzz.generate(300, seed), pool_every=10 if seed == 0 else 0,
                               max_call_s=5.0, num_workers=1)
    assert report.exceptions == []
    assert report.false_positives["ours"] == []
    assert report.rejected_controls == [] and report.slow_calls == [] and report.pool_mismatches == []
    assert report.failures == 0 and report.checked > 250
    assert report.pool_items == (60 if seed == 0 else 0)
