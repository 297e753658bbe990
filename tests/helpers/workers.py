"""What the tests need to share a machine when pytest-xdist runs them in several workers (CI runs
``pytest -n 2``; tests/README.md): a test marked ``alone`` runs with no other test beside it, and a
session's demo base is made once for all workers.

Why ``alone``: a test that gives a run a real-time window (a stop's grace, a job's time limit, an
engine held back until a deadline) asserts what fits in that window; a second test's processes on
the same 2 cores change what fits. Every other test holds the run's lock shared, an ``alone`` test
holds it exclusive. A second lock, held by a writer while it waits, keeps new shared holders out,
so an ``alone`` test waits for at most the test running beside it (flock alone lets readers starve
a writer).

Outside xdist (no ``PYTEST_XDIST_TESTRUNUID``) every lock here is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Iterator

ALONE = "alone"


def run_uid() -> str | None:
    """The xdist run's id, shared by its workers; None outside xdist."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID")


@contextlib.contextmanager
def flocked(path: Path, exclusive: bool) -> Iterator[None]:
    """``path`` flock-ed (made if missing) for the block: exclusive, or shared."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def worker_slot(alone: bool) -> Iterator[None]:
    """Held over one test's setup, call and teardown: shared, or exclusive when ``alone``."""
    uid = run_uid()
    if uid is None:
        yield
        return
    stem = Path(tempfile.gettempdir()) / f"megatron-dapo-tests-{uid}"
    turnstile, room = stem.with_suffix(".turnstile"), stem.with_suffix(".room")
    if alone:
        with flocked(turnstile, exclusive=True), flocked(room, exclusive=True):
            yield
        return
    with flocked(turnstile, exclusive=True):
        pass  # waits while an `alone` test is queued or running
    with flocked(room, exclusive=False):
        yield


def shared_dir(own: Path) -> Path:
    """A folder every worker of this run sees (``own``'s parent under xdist: pytest gives each
    worker ``.../pytest-N/popen-gwK``), else ``own``."""
    return own.parent if run_uid() is not None else own
