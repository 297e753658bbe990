"""How far an engine's generation batch has come, for whoever shows it (observe/step_progress.py).

An engine has an ``on_progress`` attribute (a ``ProgressSink``, None by default: nothing counted
or reported). Its decode loop asks the sink ``due()`` once per token step, a clock read and a
comparison, and only when it is due builds a ``GenerationProgress`` of the call so far: responses
finished, tokens generated, the longest response, the seconds since the call began. The counts
are this engine's (one replica's share of a generation batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GenerationProgress:
    """One ``generate`` call so far."""

    finished: int  # responses finished
    total: int  # responses asked for
    tokens: int  # response tokens generated so far, finished responses included
    longest: int  # the longest response so far, in tokens
    max_tokens: int  # the response limit of the call (SamplingParams.max_tokens)
    seconds: float  # since the call began

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def seconds_left_at_most(self) -> float | None:
        """An upper bound on the rest: the decode steps left to the limit at the pace of those so
        far (one token a step for every live response); None when nothing is measured or all finished."""
        if self.longest == 0 or self.finished >= self.total:
            return None
        return (self.max_tokens - self.longest) * self.seconds / self.longest


class ProgressSink(Protocol):
    def due(self) -> bool:
        """Whether a report would be shown now (cheap: asked every token step)."""

    def generation(self, progress: GenerationProgress) -> None:
        """A report, built only when ``due``."""


class GenerationCounter:
    """One ``generate`` call's counts, built by the engine for ``sink`` (None: a no-op), the call
    possibly in parts (the HF engine's chunks of max_batch_size)."""

    def __init__(self, sink: ProgressSink | None, total: int, max_tokens: int):
        self.sink, self.total, self.max_tokens = sink, total, max_tokens
        self.started = time.monotonic()
        self._finished = self._tokens = self._longest = 0  # of the parts done

    def due(self) -> bool:
        return self.sink is not None and self.sink.due()

    def report(self, finished: int, tokens: int, longest: int) -> None:
        """The part in progress: its finished responses, tokens and longest response (call when ``due``)."""
        assert self.sink is not None
        self.sink.generation(GenerationProgress(
            finished=self._finished + finished, total=self.total, tokens=self._tokens + tokens,
            longest=max(self._longest, longest), max_tokens=self.max_tokens,
            seconds=time.monotonic() - self.started))

    def part_done(self, response_lengths: Sequence[int]) -> None:
        """A part ended with responses of these lengths."""
        self._finished += len(response_lengths)
        self._tokens += sum(response_lengths)
        self._longest = max(self._longest, *response_lengths, 0)
