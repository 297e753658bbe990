"""preemption.StopRequest: the first signal asks for a stop, the same request forwarded within the
window is absorbed (Ctrl-C under torchrun), a later second signal exits at once with 128 + signal;
once the loop arms the watch, a step that cannot finish within the signal's grace is abandoned
(exit 0, naming the last checkpoint), also while the main thread is busy in a C call."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import os, signal, sys, time
from megatron_dapo.preemption import StopRequest
stop = StopRequest().install()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)  # forwarded by a launcher: the same request
time.sleep(0.1)
print("asked", stop.name, stop.agreed(), flush=True)
if sys.argv[1] == "again":
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
print("survived", flush=True)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=60)


def test_first_signal_asks_and_a_forwarded_copy_is_absorbed():
    out = _run("once")
    assert out.returncode == 0
    assert out.stdout.splitlines() == ["asked SIGINT True", "survived"]
    assert "SIGINT received: finishing this step, then saving a checkpoint" in out.stderr


def test_a_later_second_signal_exits_at_once():
    from megatron_dapo.preemption import FORWARD_WINDOW_S

    out = _run("again", str(FORWARD_WINDOW_S + 0.2))
    assert out.returncode == 128 + signal.SIGTERM
    assert "survived" not in out.stdout and "second SIGTERM: exiting now without saving" in out.stderr



SHUTDOWN_CHILD = """
import os, signal, sys
import megatron_dapo.train
from megatron_dapo import cli
megatron_dapo.train.main = lambda cfg, stop, engines: 0  # a run that has just finished
mode, config = sys.argv[1:]
args = ["train", "--config", config]
if mode == "entry":  # as the console script and python -m call it: the command line in sys.argv
    sys.argv = ["megatron-dapo", *args]
    rc = cli.main()
else:
    rc = cli.main(args)
os.kill(os.getpid(), signal.SIGTERM)  # arrives while the finished run exits
print("exited cleanly", rc, flush=True)
sys.exit(rc)
"""


def test_a_stop_signal_after_a_finished_run_does_not_kill_it():
    """As the process's own command (no argv: the console script, python -m) the trainer keeps its
    handlers to the end, so a SIGTERM during shutdown cannot turn a finished run into rc -15
    (benchmarks/fault_campaign.py caught one); called in-process with an argv, it hands the
    previous handlers back (here the default one, which kills)."""
    config = str(Path(__file__).resolve().parents[2] / "conf" / "cpu_tiny.yaml")
    run = lambda mode: subprocess.run([sys.executable, "-c", SHUTDOWN_CHILD, mode, config],
                                      capture_output=True, text=True, timeout=120)
    entry = run("entry")
    assert entry.returncode == 0 and "exited cleanly 0" in entry.stdout, entry.stderr[-2000:]
    called = run("call")
    assert called.returncode == -signal.SIGTERM, (called.returncode, called.stderr[-2000:])


WATCH_CHILD = """
import os, signal, sys, time
from megatron_dapo.preemption import StopRequest, Watch
estimate, grace, step_s, out = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
stop = StopRequest().install()
stop.watch(Watch(seconds_to_finish=lambda: estimate, last_checkpoint=lambda: "ckpt/step_00000002",
                 on_abandon=lambda line: open(out, "w").write(line), grace_s=grace, end_time=None))
start = time.monotonic()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(step_s)  # the step in flight: the main thread is busy (here in a C call)
print(f"step finished after {time.monotonic() - start:.1f} s", flush=True)
"""


def _watched(tmp_path, estimate: float, grace: float, step_s: float):
    out = tmp_path / "abandoned.txt"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WATCH_CHILD, str(estimate), str(grace), str(step_s), str(out)],
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - start, out.read_text() if out.exists() else None


def test_a_step_that_cannot_finish_within_the_grace_is_abandoned_at_once(tmp_path):
    done, seconds, line = _watched(tmp_path, estimate=100.0, grace=25.0, step_s=30.0)
    assert done.returncode == 0 and "step finished" not in done.stdout
    assert seconds < 10  # at the signal, not after the 30 s step nor at the end of the grace
    assert line.startswith("megatron-dapo: SIGTERM: the step in flight and its checkpoint need ~100 s, more than the "
                           "25 s")
    assert "the last checkpoint is ckpt/step_00000002, rerun the same command to resume from it" in line
    assert line in done.stderr


def test_a_step_that_fits_finishes_and_one_that_overruns_is_abandoned_before_the_kill(tmp_path):
    done, _, line = _watched(tmp_path, estimate=1.0, grace=6.0, step_s=1.0)
    assert done.returncode == 0 and "step finished" in done.stdout and line is None
    done, seconds, line = _watched(tmp_path, estimate=1.0, grace=6.0, step_s=30.0)  # the estimate was wrong
    assert done.returncode == 0 and "step finished" not in done.stdout
    assert 3.5 < seconds < 10  # grace 6 - ABANDON_SAFETY_S 2, after start-up
    assert "did not finish within the 6 s before the kill" in line


ERROR_CHILD = """
import os, signal, sys, time
from megatron_dapo.preemption import StopRequest, Watch
stop = StopRequest().install()
if sys.argv[1] == "armed":
    stop.watch(Watch(seconds_to_finish=lambda: 1.0, last_checkpoint=lambda: "none yet",
                     on_abandon=lambda line: None, grace_s=25.0, end_time=None))
if sys.argv[2] == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
try:
    raise RuntimeError("Connection closed by peer")  # gloo, after a peer abandoned its step
except Exception as e:
    stop.abandon_if_stopping(e)
    raise
"""


@pytest.mark.parametrize("armed, sent, rc", [("armed", "signal", 0), ("armed", "none", 1), ("unarmed", "signal", 1)])
def test_an_error_after_a_stop_signal_ends_the_rank_like_its_peer(armed, sent, rc):
    done = subprocess.run([sys.executable, "-c", ERROR_CHILD, armed, sent], capture_output=True, text=True, timeout=60)
    assert done.returncode == rc, done.stderr
    if rc == 0:
        assert "SIGTERM, then RuntimeError in the step in flight (Connection closed by peer): abandoning" in done.stderr
    else:
        assert "Traceback" in done.stderr  # without a stop request an error stays an error


def test_seconds_left_to_the_kill_are_counted_as_the_watchdog_counts_them():
    """What a stop may spend waiting for the batches in flight (train.py, before a step's sync):
    ``seconds_left``, and ``deadline`` = now + that - what must follow the wait."""
    from megatron_dapo.preemption import TIME_LIMIT, StopRequest, Watch

    def stopped(signum, *, since: float, end_time: float | None) -> StopRequest:
        stop = StopRequest()  # not installed: no handlers, the request set as the handler sets it
        stop.watch(Watch(seconds_to_finish=lambda: 0.0, last_checkpoint=lambda: "none yet", on_abandon=print,
                         grace_s=25.0, end_time=end_time))
        stop.signum, stop.received_at = int(signum), time.monotonic() - since
        return stop

    end = time.time() + 100
    assert stopped(signal.SIGTERM, since=3, end_time=end).seconds_left() == pytest.approx(22, abs=0.5)
    assert stopped(signal.SIGINT, since=30, end_time=None).seconds_left() == pytest.approx(-5, abs=0.5)
    assert stopped(signal.SIGUSR1, since=3, end_time=end).seconds_left() == pytest.approx(100, abs=0.5)
    assert stopped(TIME_LIMIT, since=0, end_time=end).seconds_left() == pytest.approx(100, abs=0.5)
    assert stopped(signal.SIGUSR1, since=3, end_time=None).seconds_left() is None  # no end: no kill foreseen
    assert StopRequest().seconds_left() is None
    assert (stopped(signal.SIGTERM, since=3, end_time=end).deadline(10.0) - time.monotonic()
            == pytest.approx(12, abs=0.5))
    assert StopRequest().deadline(10.0) is None and stopped(signal.SIGUSR1, since=3, end_time=None).deadline(1) is None


CUT_CHILD = """
import os, signal, sys, threading, time
from megatron_dapo.preemption import StopRequest, Watch
estimate, grace, to_save = map(float, sys.argv[1:4])
cut = threading.Event()
def cut_short():
    cut.set()
    return True
stop = StopRequest().install()
stop.watch(Watch(seconds_to_finish=lambda: estimate, last_checkpoint=lambda: "ckpt/step_00000002",
                 on_abandon=lambda line: print("abandoned", flush=True), grace_s=grace, end_time=None,
                 cut_short=cut_short, seconds_to_save=lambda: to_save))
start = time.monotonic()
os.kill(os.getpid(), signal.SIGTERM)
cut.wait(30)  # the step's generation, until it is cut
print(f"cut after {time.monotonic() - start:.1f} s", flush=True)
time.sleep(0.3)  # the save of the step's start
stop.saved()
time.sleep(0.5)
"""


@pytest.mark.parametrize("estimate, grace, to_save, cut_from, cut_by", [
    (100.0, 25.0, 1.0, 0.0, 2.0),  # the step cannot fit: its generation is cut at once
    (1.0, 8.0, 3.0, 2.5, 4.5),  # it should fit but overruns: cut when only the save still fits (8 - 2 - 3)
])
def test_a_step_still_generating_is_cut_short_rather_than_abandoned(estimate, grace, to_save, cut_from, cut_by):
    done = subprocess.run([sys.executable, "-c", CUT_CHILD, str(estimate), str(grace), str(to_save)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.split("cut after ")[1].split(" s")[0])
    assert cut_from <= seconds < cut_by and "abandoned" not in done.stdout, done.stdout
