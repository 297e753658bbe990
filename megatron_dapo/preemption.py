"""Graceful stop: SIGTERM (SLURM preemption and time limit, ``scancel``, torchrun's shutdown), SIGUSR1
(SLURM's ``--signal=USR1@<seconds>``) and SIGINT (Ctrl-C) ask the trainer to stop at the next step
boundary; the job's time limit (time_limit.py) asks the same without a signal.

The first signal sets a flag and prints one line. The loop finishes the step it is in (a step that
has started updating the weights cannot be cut short without losing its updates), then all ranks
agree to stop (one all-reduce per step, so ranks that got the signal at different moments, or the
rank that alone knows the time limit, stop after the same step), save a checkpoint and exit 0 with
one line naming it.

A signal comes with a grace period before SIGKILL: ``checkpoint.stop_grace_s`` for SIGTERM and
SIGINT (torchrun waits 30 s after forwarding SIGTERM, SLURM's KillWait is 30 s by default), the
time left until the job's end for SIGUSR1 (none when the end is unknown). A step still generating
has trained nothing yet, so it can be cut short: its generation aborted, the state as of its start
saved (the steps since the last checkpoint kept), the step redone on resume. The watchdog cuts it
at once when the step in flight and a save cannot fit in the grace (from the measured step and
save times, time_limit.StepClock), else when only the cut's save still fits (an estimate that was
too low: a long tail of responses). A step past its generation cannot be cut; when it and a save
cannot fit, it is abandoned at once, else just before the grace runs out. An abandoned step exits 0
naming the last checkpoint: every saved step stays as it was (saves are atomic,
mcore/checkpoint.py), only the unsaved steps are redone on resume. The watchdog learns of a signal
from the interpreter's wakeup fd, so it acts even while the main thread sits in a long collective
or kernel, where Python-level handlers cannot run.

A second signal (more than FORWARD_WINDOW_S after the first) exits at once without a checkpoint
(exit code 128 + signal).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo import ranks

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A second signal this soon after the first is the same request: Ctrl-C under torchrun reaches each
# worker directly (SIGINT, from the terminal) and again through the agent (SIGTERM), and SLURM's
# time limit reaches the workers directly and through torchrun, milliseconds apart.
FORWARD_WINDOW_S = 2.0
TIME_LIMIT = 1000  # the stop code of "the next step would cross the job's end" (not a signal number)
ABANDON_SAFETY_S = 2.0  # the watchdog exits this long before the grace ends: SIGKILL must not win


@dataclass
class Watch:
    """What the watchdog needs to decide and to report (set by the loop once it has them)."""

    seconds_to_finish: Callable[[], float | None]  # the step in flight + a save; None: unknown
    last_checkpoint: Callable[[], str]  # for the exit line: "runs/x/checkpoints/step_00000012" or "none yet"
    on_abandon: Callable[[str], None]  # called with the exit line before the process exits 0
    grace_s: float  # SIGTERM / SIGINT
    end_time: float | None  # the job's end (SIGUSR1's grace), seconds since the epoch
    cut_short: Callable[[], bool] = lambda: False  # aborts the step's generation if it is generating
    seconds_to_save: Callable[[], float] = lambda: 0.0  # a cut step's save (of the step's start; 0: none due)


class StopRequest:
    """Installs the handlers (main thread only; elsewhere it stays inert) and keeps the request."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup: int | None = None
        self._socks: tuple[socket.socket, socket.socket] | None = None
        self._watch: Watch | None = None
        self._watched = threading.Event()  # the watchdog has seen a first signal
        self._first: signal.Signals | None = None  # which (the handler may not have run yet)
        self._saved = threading.Event()  # the stop's checkpoint is written: nothing left to abandon

    @property
    def name(self) -> str:
        if self.signum == TIME_LIMIT:
            return "the job's time limit"
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._socks = socket.socketpair()
            self._socks[1].setblocking(False)
            self._previous_wakeup = signal.set_wakeup_fd(self._socks[1].fileno(), warn_on_full_buffer=False)
            threading.Thread(target=self._watchdog, args=(self._socks[0],), daemon=True,
                             name="megatron-dapo-stop-watchdog").start()
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._socks is not None:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            self._socks[1].close()  # the watchdog's recv returns b"" and it ends
            self._socks = None

    def watch(self, watch: Watch) -> None:
        """Arms abandonment: from now on a signal whose grace cannot hold the step in flight ends it."""
        self._watch = watch

    def request(self, code: int) -> None:
        """A stop asked for by the trainer itself (``TIME_LIMIT``), agreed like a signal."""
        if self.signum is None:
            self.signum, self.received_at = code, time.monotonic()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None and time.monotonic() - self.received_at < FORWARD_WINDOW_S:
            return  # the same request again: Ctrl-C reaches torchrun's workers directly and forwarded
        if self.signum is not None and self.signum != TIME_LIMIT:
            print(f"megatron-dapo: second {name}: exiting now without saving; rerun to resume from the "
                  "last checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        if ranks.rank() == 0:
            print(f"megatron-dapo: {name} received: finishing this step, then saving a checkpoint "
                  f"(send {name} again to exit at once)", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the watchdog thread
    def _watchdog(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS and not self._watched.is_set():
                    self._first = signal.Signals(signum)
                    self._watched.set()
                    self._on_first_signal(signal.Signals(signum), time.monotonic())

    def _on_first_signal(self, sig: signal.Signals, received: float) -> None:
        watch = self._watch
        if watch is None:  # before the loop: set-up is not abandoned (nothing to lose, nothing saved)
            return
        if sig == signal.SIGUSR1:
            if watch.end_time is None:
                return  # an early warning without a known end: finish the step, however long
            grace = watch.end_time - time.time()
        else:
            grace = watch.grace_s
        need = watch.seconds_to_finish()
        budget = grace - ABANDON_SAFETY_S
        left = lambda: max(budget - (time.monotonic() - received), 0.0)  # noqa: E731
        if need is not None and need > budget:
            if not watch.cut_short():  # past its generation: nothing to save it by
                self._abandon(watch, f"{sig.name}: the step in flight and its checkpoint need ~{need:.0f} s, more "
                                     f"than the {grace:.0f} s before the kill")
                return
        elif not self._saved.wait(max(left() - watch.seconds_to_save(), 0.0)):
            watch.cut_short()  # the step may have overrun its estimate: while a save still fits
        if self._saved.wait(left()):
            return  # the rest (the curves, the report, the exit) is not worth abandoning the save for
        self._abandon(watch, f"{sig.name}: the step and its checkpoint did not finish within the {grace:.0f} s "
                             "before the kill")

    def _abandon(self, watch: Watch, why: str) -> None:
        line = (f"megatron-dapo: {why}: abandoning the step; the last checkpoint is {watch.last_checkpoint()}, "
                "rerun the same command to resume from it")
        try:
            watch.on_abandon(line)
            if ranks.rank() == 0:
                print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(0)

    def saved(self) -> None:
        """The stop's checkpoint is written: the watchdog stands down."""
        self._saved.set()

    def abandon_if_stopping(self, error: BaseException) -> None:
        """After a stop signal, an error in the step (typically a collective broken by a peer that
        abandoned its step first) ends this rank like that peer: exit 0 naming the last
        checkpoint. Without a signal, or before the loop armed the watch, it returns (a bug is a bug)."""
        watch, sig = self._watch, self._first
        if watch is None or sig is None:
            return
        self._abandon(watch, f"{sig.name}, then {type(error).__name__} in the step in flight ({error})"[:400])

    def agreed(self) -> bool:
        """True on every rank iff any rank got a signal or asked for a stop; collective when
        torch.distributed is up."""
        signum = ranks.max_over_ranks(0 if self.signum is None else self.signum)
        if self.signum is None and signum:
            self.signum, self.received_at = signum, time.monotonic()
        return bool(signum)

    def seconds_left(self) -> float | None:
        """Seconds from now to the kill this stop's grace allows, as the watchdog counts them: the
        job's end for SIGUSR1 and a time-limit stop, else checkpoint.stop_grace_s from the signal (on a
        rank that learned of it through ``agreed``, from then). None: no kill is foreseen (SIGUSR1
        without a known end) or nothing was asked for."""
        watch = self._watch
        if watch is None or self.signum is None:
            return None
        if self.signum in (signal.SIGUSR1, TIME_LIMIT):
            return None if watch.end_time is None else watch.end_time - time.time()
        return watch.grace_s - self.seconds_since()

    def deadline(self, reserve_s: float) -> float | None:
        """The time.monotonic() by which work must end to leave ``reserve_s`` before this stop's kill;
        None while no stop is asked for, or when no kill is foreseen (``seconds_left``)."""
        left = self.seconds_left()
        return None if left is None else time.monotonic() + left - reserve_s

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at


