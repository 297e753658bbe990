"""Resident memory of this process, for the benchmarks that measure it (Linux /proc)."""

from __future__ import annotations

import ctypes
import gc
import re


def rss_mb(field: str = "VmRSS") -> float:
    """``field`` of /proc/self/status in MiB: VmRSS now, or VmHWM, the peak since reset_peak()."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def reset_peak() -> None:
    """Return freed heap pages to the OS (glibc keeps what setup freed, e.g. megatron's parameters
    before DDP moved them into one buffer), then restart the peak from the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


class TreePeak:
    """The peak resident memory of this process and its live children together, in MiB: a thread
    sums their RSS every ``interval_s`` (psutil) and keeps the largest sum; ``peak_mb()`` is at least
    this process's own VmHWM. Children's short peaks between samples can be missed. Not
    ru_maxrss of RUSAGE_CHILDREN: that counts a forked child's copy-on-write view of the parent's
    pages as its own (a 60 MB reward worker read as 515 MB)."""

    def __init__(self, interval_s: float = 0.05):
        import threading

        import psutil

        self._me, self._interval, self._peak = psutil.Process(), interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self._interval):
            total = 0
            for p in [self._me, *self._me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:  # ended between the listing and the read
                    pass
            self._peak = max(self._peak, total / 2**20)

    def peak_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self._peak, rss_mb("VmHWM"))
