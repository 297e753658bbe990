"""preemption.StopRequest: the first signal asks for a stop, the same request forwarded within the
window is absorbed (Ctrl-C under torchrun), a later second signal exits at once with 128 + signal."""

import signal
import subprocess
import sys

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
