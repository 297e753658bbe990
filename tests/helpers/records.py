"""metrics.jsonl records and the one rule for comparing two runs' records.

A record splits into an exact part (rollouts, rewards, dynamic sampling, evaluation: the same
seeded work gives the same numbers) and a round-off part (the trainer's update and the log-probs
computed from it, whose summation order depends on the layout); wall times are never compared.
"""

import json
from pathlib import Path

# rollout/token_prob_mean: the engine's probabilities of the sampled tokens, whose logits move by fp32
# round-off with the batch a response is decoded in (hf_engine.py: ~1e-7); on one machine they came out
# bit-identical across layouts, on another (2026-12-05, the code of a6c445f too) 2e-10 apart
ROUND_OFF = ("actor/", "rollout/logprob", "rollout/token_prob_mean")
# Counts of micro-batches per DP rank: another layout splits a batch into other micro-batches.
LAYOUT_COUNTS = ("actor/num_micro_batches", "actor/grad_shortcut_used", "actor/grad_shortcut_fallbacks")
WALL_TIME = ("timing", "time")


def records(run_dir: Path) -> list[dict]:
    """The run's records so far: complete lines only (polled while the trainer writes, the last line
    may be half written); none before the file exists."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line]


def timed(run_dir: Path, phase: str) -> bool:
    """The run's last record holds ``timing_s/<phase>``: the step ran that phase."""
    path = Path(run_dir) / "metrics.jsonl"
    return path.exists() and f"timing_s/{phase}" in records(run_dir)[-1]


def split(record: dict, round_off: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(exact part, round-off part); ``round_off``: more key prefixes compared to round-off."""
    rounded = {k: v for k, v in record.items() if k.startswith((*ROUND_OFF, *round_off))}
    exact = {k: v for k, v in record.items() if k not in rounded and not k.startswith(WALL_TIME)}
    return exact, rounded


def assert_same_record(got: dict, want: dict, *, round_off: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
                       rel: float = 1e-5) -> None:
    """The exact part equal, the round-off part to ``rel`` (absolute below 1); ``ignore``: keys
    that differ by construction (e.g. micro-batches per rank at another layout)."""
    got, want = ({k: v for k, v in r.items() if k not in ignore} for r in (got, want))
    (g_exact, g_round), (w_exact, w_round) = split(got, round_off), split(want, round_off)
    assert g_exact == w_exact, got["step"]
    assert g_round.keys() == w_round.keys(), got["step"]
    bad = {k: (g_round[k], w) for k, w in w_round.items() if abs(g_round[k] - w) > rel * max(1.0, abs(w))}
    assert not bad, (got["step"], bad)


def assert_same_records(run_dir: Path, reference: Path, **kw) -> None:
    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert_same_record(g, w, **kw)
