"""Runs a training command and ends it, with every process's Python stacks, if it stops making steps.

    python tools/hang_watch.py --run DIR --stall S [--first S0] -- COMMAND [ARG ...]

Watches ``DIR/metrics.jsonl`` (one record a step): when no new record comes for ``--stall`` seconds
(``--first`` before the first record: start-up, engine builds), the run is taken as hung. Then every
Python process of the command gets SIGABRT, which Python's faulthandler (on for the command:
PYTHONFAULTHANDLER=1) answers by printing each of its threads' stacks to its stderr, so the log shows
where each rank waits (a collective, a store wait, a lock); the command's process group is then
killed and this exits 1 naming the last step. Otherwise it exits with the command's status. A time
box around the whole stage is the caller's (tools/node_smoke.sh); this is the finer detector inside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

POLL_S = 1.0
DUMP_S = 10.0  # how long the stacks get to be written before the kill


def records(path: Path) -> int:
    """The number of complete lines in ``path`` (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def watch(command: list[str], metrics: Path, *, stall_s: float, first_s: float,
          poll_s: float = POLL_S) -> int:
    """Runs ``command``; its exit status, or 1 once it stopped writing records (module doc)."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    seen, since = records(metrics), time.monotonic()
    while proc.poll() is None:
        time.sleep(poll_s)
        count = records(metrics)
        if count != seen:
            seen, since = count, time.monotonic()
            continue
        limit = stall_s if seen else first_s
        if time.monotonic() - since > limit:
            return _hung(proc, metrics, seen, limit)
    return proc.returncode


def _hung(proc: subprocess.Popen, metrics: Path, seen: int, limit: float) -> int:
    print(f"hang_watch: no new record in {metrics} for {limit:.0f} s after {seen} record(s); every process's "
          "stacks follow (faulthandler)", file=sys.stderr, flush=True)
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            if "python" in p.name().lower() or any("python" in part for part in p.cmdline()[:1]):
                p.send_signal(signal.SIGABRT)
        except psutil.Error:
            continue
    time.sleep(DUMP_S)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    print(f"FAIL: hung after {seen} record(s): nothing for {limit:.0f} s (the stacks above show where each "
          "process waited)", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=Path, help="the run's logging.dir (its metrics.jsonl)")
    parser.add_argument("--stall", type=float, required=True, help="seconds without a new record: a hang")
    parser.add_argument("--first", type=float, help="the same before the first record (default: 3 x --stall)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    return watch(command, args.run / "metrics.jsonl", stall_s=args.stall,
                 first_s=args.first if args.first is not None else 3 * args.stall)


if __name__ == "__main__":
    sys.exit(main())
