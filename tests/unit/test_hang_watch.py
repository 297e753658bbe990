"""tools/hang_watch.py on real processes: a run that keeps writing records is left to finish (its exit
status passes through); one that stops writing them is ended after --stall seconds, with every
Python process's stacks in its log (faulthandler, through SIGABRT), the function it hung in among
them, and exit 1 naming how many records came; a child process (a rank under a launcher) is dumped
and killed too."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WATCH = ROOT / "tools" / "hang_watch.py"

WRITER = """
import json, subprocess, sys, time
from pathlib import Path
metrics = Path(sys.argv[1]) / "metrics.jsonl"
steps, hang = int(sys.argv[2]), sys.argv[3] == "hang"
RANK = "import time\\ndef rank_waiting_in_a_collective():\\n time.sleep(600)\\nrank_waiting_in_a_collective()"
child = subprocess.Popen([sys.executable, "-c", RANK]) if hang else None
for step in range(1, steps + 1):
    time.sleep(0.2)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": step}) + "\\n")

def trainer_stuck_after_its_records():
    time.sleep(600)

if hang:
    trainer_stuck_after_its_records()
sys.exit(3)
"""


def _watch(tmp_path, mode: str, stall: float = 2.0):
    script = tmp_path / "run.py"
    script.write_text(WRITER)
    watch = [sys.executable, str(WATCH), "--run", str(tmp_path), "--stall", str(stall), "--first", "5"]
    return subprocess.run([*watch, "--", sys.executable, str(script), str(tmp_path), "4", mode],
                          capture_output=True, text=True, timeout=120)


def test_a_run_that_keeps_stepping_keeps_its_exit_status(tmp_path):
    out = _watch(tmp_path, "finish", stall=2.0)
    assert out.returncode == 3 and "hang_watch" not in out.stderr, out.stderr


@pytest.mark.slow  # the stall, then the 10 s the stacks get
def test_a_run_that_stops_stepping_is_ended_with_every_process_s_stacks(tmp_path):
    started = time.monotonic()
    out = _watch(tmp_path, "hang", stall=2.0)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no new record" in out.stderr and "after 4 record(s)" in out.stderr
    assert "trainer_stuck_after_its_records" in out.stderr and "rank_waiting_in_a_collective" in out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("FAIL: hung after 4 record(s)")
    assert time.monotonic() - started < 60
