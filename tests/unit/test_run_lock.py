"""run_lock.RunDirLock: one holder at a time, the refusal names the holder, a dead holder's file is taken over."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from megatron_dapo.errors import InputError
from megatron_dapo.run_lock import LOCK_FILE, RunDirLock


def test_second_holder_is_refused_with_the_holders_pid_and_host(tmp_path):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(InputError, match=rf"is in use by another trainer \(pid {os.getpid()} on host "
                                             rf"{socket.gethostname()}, since "):
            RunDirLock(tmp_path / "run").acquire()  # another open file: flock conflicts within a process too
    RunDirLock(tmp_path / "run").acquire().release()  # released: free again
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # a clean exit leaves no holder named


def test_a_killed_holders_lock_is_taken_over_saying_so(tmp_path, caplog):
    code = (f"from megatron_dapo.run_lock import RunDirLock; RunDirLock({str(tmp_path)!r}).acquire(); "
            "import os; os._exit(0)")  # dies holding it, without releasing
    subprocess.run([sys.executable, "-c", code], check=True)
    dead = json.loads((tmp_path / LOCK_FILE).read_text())
    assert dead["pid"] != os.getpid()
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.run_lock"):
        lock = RunDirLock(tmp_path).acquire()
    assert f"taking over from pid {dead['pid']} on host {dead['host']}" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_live_holder_in_another_process_is_refused(tmp_path):
    code = (f"from megatron_dapo.run_lock import RunDirLock; RunDirLock({str(tmp_path)!r}).acquire(); "
            "print('held', flush=True); import sys; sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InputError, match=f"pid {holder.pid} on host"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.communicate("")
    RunDirLock(tmp_path).acquire().release()  # its exit dropped the lock
