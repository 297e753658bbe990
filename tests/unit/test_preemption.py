"""preemption.StopRequest: the first signal asks for a stop, the same request forwarded within the
window is absorbed (Ctrl-C under torchrun), a later second signal exits at once with 128 + signal."""

import signal
import subprocess
import sys
from pathlib import Path

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
megatron_dapo.train.main = lambda cfg, stop: 0  # a run that has just finished
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
