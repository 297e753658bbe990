"""tests/helpers/workers.py: under xdist an `alone` test waits for the test beside it to end, and
no test starts beside it once it waits; outside xdist the slot is free. Threads stand in for the
workers (flock locks belong to each open file, so two threads conflict as two processes do)."""

import threading
import time

from tests.helpers.workers import shared_dir, worker_slot


def _hold(alone: bool, seconds: float, events: list, name: str, started: threading.Event | None = None):
    with worker_slot(alone=alone):
        events.append(("in", name, time.monotonic()))
        if started is not None:
            started.set()
        time.sleep(seconds)
        events.append(("out", name, time.monotonic()))


def test_an_alone_test_waits_for_its_neighbour_and_holds_back_the_next(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"unit-{tmp_path.name}")
    events: list = []
    first_in = threading.Event()
    first = threading.Thread(target=_hold, args=(False, 0.6, events, "shared-1", first_in))
    first.start()
    first_in.wait(5)
    alone = threading.Thread(target=_hold, args=(True, 0.6, events, "alone"))
    alone.start()
    time.sleep(0.2)  # the alone test is queued: a shared test asked for now must wait for it
    second = threading.Thread(target=_hold, args=(False, 0.1, events, "shared-2"))
    second.start()
    for t in (first, alone, second):
        t.join(10)
    order = [(kind, name) for kind, name, _ in events]
    assert order == [("in", "shared-1"), ("out", "shared-1"), ("in", "alone"), ("out", "alone"),
                     ("in", "shared-2"), ("out", "shared-2")], order


def test_shared_tests_run_side_by_side(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"unit-{tmp_path.name}")
    events: list = []
    threads = [threading.Thread(target=_hold, args=(False, 0.5, events, f"shared-{k}")) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [kind for kind, _, _ in events][:2] == ["in", "in"], events


def test_without_xdist_nothing_is_locked(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with worker_slot(alone=True), worker_slot(alone=True):  # would deadlock if it locked
        pass
    assert shared_dir(tmp_path) == tmp_path
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "x")
    assert shared_dir(tmp_path) == tmp_path.parent
