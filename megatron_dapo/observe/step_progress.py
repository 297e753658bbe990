"""What a step is doing while it does it: rank 0's progress inside a step (``logging.progress``).

A 32B step lasts about an hour, and the step line (metrics_log.format_progress) comes at its end.
Each part of a step tells a ``StepProgress`` where it is: the rollout (which generation batch,
dynamic sampling's kept groups of those needed), the engine's decode loop (responses finished,
tokens/s, the longest response, an upper bound on the time left: rollout/gen_progress.py), the
old log-probs, the updates (mini-batch i of N), the weight sync, the evaluation and the save.

On a terminal one line is rewritten in place, at most ``TTY_EVERY_S`` apart, and cleared at the
step's end. In a log (stdout not a terminal) a line is written every ``logging.progress_every_s``
seconds: a step shorter than that prints its step line only. Between two lines a report costs a
clock read and a comparison (``due``), which the engines ask before they count anything
(benchmarks/progress_overhead.py measures it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from megatron_dapo.rollout.gen_progress import GenerationProgress

TTY_EVERY_S = 0.5


def fmt_seconds(seconds: float) -> str:
    """``0.4s``, ``42s``, ``3m07s``, ``1h02m``."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def generation_detail(p: GenerationProgress) -> str:
    """``responses 812/2048 | 3,211 tok/s | longest 8,190/20,480 | at most 6m12s left``."""
    parts = [f"responses {p.finished}/{p.total}", f"{p.tokens_per_s():,.0f} tok/s",
             f"longest {p.longest:,}/{p.max_tokens:,}"]
    left = p.seconds_left_at_most()
    if left is not None:
        parts.append(f"at most {fmt_seconds(left)} left")
    return " | ".join(parts)


class StepProgress:
    """Rank 0's in-step progress (module doc); every method is a no-op when not ``enabled``.

    Args:
        total_steps: train.total_steps, for ``step 4/10``.
        every_s: seconds between two lines in a log (logging.progress_every_s).
        enabled: rank 0 with logging.progress.
        stream: where lines go (stdout); ``tty``: whether it is a terminal (default: asked).
        clock: time.monotonic, or a test's.
    """

    def __init__(self, total_steps: int, every_s: float, *, enabled: bool = True, stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.enabled, self.total_steps, self.clock = enabled, total_steps, clock
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = TTY_EVERY_S if self.tty else every_s
        self.step = 0
        self.name = ""  # the phase: "generating", "updating", ...
        self.context = ""  # what the phase says of itself (a generation batch, kept groups)
        self.started = self.clock()  # the phase's
        self._next = float("inf")  # when a line is due
        self._shown = False  # a terminal line is on screen

    def begin_step(self, step: int) -> None:
        """Step ``step`` (from 1) begins: its first line is due ``every_s`` from now."""
        self.step = step
        self._next = self.clock() + self.every_s

    def phase(self, name: str, context: str = "", *, last_s: float | None = None) -> None:
        """A part of the step begins (its clock starts; the lines' rhythm goes on). ``last_s``: how long
        it took last time, for a part that reports nothing while it runs (a save, a weight sync): when
        that is a line's interval or more, a line says so now."""
        self.name, self.context, self.started = name, context, self.clock()
        if self.enabled and last_s is not None and last_s >= self.every_s:
            self._show(f"the last took {fmt_seconds(last_s)}")

    def due(self) -> bool:
        """Whether a line would be shown now (rollout/gen_progress.ProgressSink)."""
        return self.enabled and self.clock() >= self._next

    def note(self, detail: str = "") -> None:
        """The phase's state now; shown when due."""
        if self.due():
            self._show(detail)

    def count(self, done: int, total: int, unit: str) -> None:
        """``done`` of ``total`` ``unit``s of the phase, with a linear estimate of the rest."""
        if not self.due():
            return
        elapsed = self.clock() - self.started
        left = f" | about {fmt_seconds(elapsed * (total - done) / done)} left" if 0 < done < total else ""
        self._show(f"{unit} {done}/{total}{left}")

    def generation(self, progress: GenerationProgress) -> None:
        """The engine's report (rollout/gen_progress.ProgressSink), built when ``due``."""
        self._show(generation_detail(progress))

    def end_step(self) -> None:
        """Before the step line: a terminal's line is cleared."""
        if self._shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._shown = False
        self._next = float("inf")

    def _show(self, detail: str) -> None:
        now = self.clock()
        self._next = now + self.every_s
        head = f"  step {self.step}/{self.total_steps} {self.name}"
        parts = [head + (f" ({self.context})" if self.context else ""), detail,
                 f"{fmt_seconds(now - self.started)} so far"]
        line = " | ".join(p for p in parts if p)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:_width()])
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _width() -> int:
    import shutil

    return shutil.get_terminal_size((120, 20)).columns - 1
