"""The per-prompt pass-rate ledger: every training prompt's attempts and correct responses over a run.

Dynamic sampling sees a prompt's group once and forgets it; the ledger keeps, for every prompt drawn
so far, how many responses it got, how many were correct, and for how many consecutive draws all of
them were. It is updated from every generated group (kept or dropped), saved in the trainer state and
restored exactly. Its histogram (the spread of pass rates over the prompts seen) goes to the metrics
each step.

Curation (``data.skip_solved_after: K``, off by default): a prompt solved by every response K draws
in a row is skipped when the sampler next offers it, counted in ``ledger/skipped_total`` (POLARIS
and Skywork-OR1 drop such prompts by hand between runs). Skipping happens where prompts are drawn, so
the sampler's own order and state are those of an uncurated run.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.errors import InputError

# Pass-rate buckets of the logged histogram: [0], (0, .25], ..., (.75, 1), [1].
BUCKETS = ("0", "0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1", "1")


@dataclass
class PromptRecord:
    attempts: int = 0  # responses generated for the prompt
    correct: int = 0
    draws: int = 0  # times its group was generated
    solved_streak: int = 0  # consecutive draws with every response correct


class PassRateLedger:
    def __init__(self, skip_solved_after: int = 0):
        self.skip_after = skip_solved_after
        self.records: dict[int, PromptRecord] = {}
        self.skipped_total = 0

    def record(self, indices: list[int], acc: list[list[bool]]) -> None:
        """One generation batch: ``acc[p]`` the G verdicts of prompt ``indices[p]``."""
        for index, row in zip(indices, acc):
            rec = self.records.setdefault(int(index), PromptRecord())
            rec.attempts += len(row)
            rec.correct += sum(bool(a) for a in row)
            rec.draws += 1
            rec.solved_streak = rec.solved_streak + 1 if row and all(row) else 0

    def retired(self, index: int) -> bool:
        rec = self.records.get(index)
        return bool(self.skip_after) and rec is not None and rec.solved_streak >= self.skip_after

    def draw(self, sampler, k: int) -> tuple[list[int], int]:
        """The next ``k`` prompts of ``sampler`` that are not retired, and how many were skipped."""
        if not self.skip_after:
            return sampler.next_indices(k), 0
        out: list[int] = []
        skipped = run = 0  # run: skips since the last usable prompt
        while len(out) < k:
            index = sampler.next_indices(1)[0]
            if self.retired(index):
                skipped += 1
                run += 1
                if run > sampler.num_items:  # a whole epoch without a usable prompt
                    raise InputError(
                        f"every one of the {sampler.num_items} training prompts is retired by data.skip_solved_after="
                        f"{self.skip_after} (solved by every response that many draws in a row): nothing left to "
                        "learn from; raise data.skip_solved_after (or set it to 0) to go on, or stop the run here")
                continue
            run = 0
            out.append(index)
        self.skipped_total += skipped
        return out, skipped

    def metrics(self) -> dict[str, float]:
        """The histogram of pass rates over the prompts seen (fractions), and the curation counts."""
        rates = self.pass_rates()
        hist = [0] * len(BUCKETS)
        for rate in rates:
            hist[_bucket(rate)] += 1
        n = max(1, len(rates))
        out = {"ledger/prompts_seen": float(len(rates)), "ledger/skipped_total": float(self.skipped_total),
               "ledger/retired": float(sum(self.retired(i) for i in self.records)) if self.skip_after else 0.0}
        out |= {f"ledger/pass_rate_{name}": count / n for name, count in zip(BUCKETS, hist)}
        return out

    def pass_rates(self) -> list[float]:
        return [r.correct / r.attempts for r in self.records.values() if r.attempts]

    def state(self) -> dict:
        """Plain JSON: {"skipped_total": n, "records": {index: [attempts, correct, draws, streak]}}."""
        return {"skipped_total": self.skipped_total,
                "records": {str(i): [r.attempts, r.correct, r.draws, r.solved_streak]
                            for i, r in sorted(self.records.items())}}

    def restore(self, state: dict) -> None:
        self.skipped_total = int(state.get("skipped_total", 0))
        self.records = {int(i): PromptRecord(*map(int, v)) for i, v in state.get("records", {}).items()}


def _bucket(rate: float) -> int:
    if rate <= 0:
        return 0
    if rate >= 1:
        return len(BUCKETS) - 1
    return min(4, 1 + int(rate * 4 - 1e-12))
