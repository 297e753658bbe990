"""One trainer per run directory: an advisory lock held for the life of the trainer.

The lock is ``fcntl.flock`` on ``<run dir>/.lock`` (taken by rank 0 before anything is written
there). The kernel drops a flock when its holder dies however it dies, so a SIGKILLed trainer never
leaves a lock that blocks the rerun; the file itself stays and names its last holder (pid, host,
start time). A second trainer on the same directory is refused with one line naming the holder; a
trainer that finds the file of a holder that is gone says that it takes the directory over.
Evaluation (``megatron-dapo eval``) reads a live run without the lock.

File systems without flock support (some Lustre mounts) get a warning and run unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from megatron_dapo.errors import InputError

logger = logging.getLogger(__name__)
LOCK_FILE = ".lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirLock:
    """``with RunDirLock(run_dir):`` or ``acquire()`` / ``release()``; raises InputError when held."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # under a file, a read-only or pseudo file system
            raise InputError(f"logging.dir={self.path.parent}: cannot create it ({e.strerror}); set logging.dir "
                             "to a directory this user can write") from None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise InputError(f"{self.path.parent} is in use by another trainer ({holder}): wait for it to "
                             "finish or stop it, or set logging.dir to another directory") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _UNSUPPORTED:
                raise
            logger.warning("%s: the file system does not support locks (%s); running without the "
                           "one-trainer-per-directory check", self.path, e.strerror)
            return self
        previous = _read(fd)
        if previous:
            logger.warning("%s: taking over from %s, which is no longer running", self.path.parent,
                           _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_info()) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Empties the file (a clean exit leaves no holder to report) and drops the lock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except ValueError:  # a holder killed while writing it
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('since')}"
