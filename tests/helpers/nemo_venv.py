"""Runs tests/nemo_aligner's probes inside .venv-nemo (the real NeMo-Aligner 0.7.0 stack) from the
main suite: a skip naming the install command where the venv is absent, a free port per launch,
none of this process's launcher variables, the probe's JSON back or its output's tail on failure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NEMO_VENV = REPO / ".venv-nemo"
NEMO_PYTHON = NEMO_VENV / "bin" / "python"
TORCHRUN = NEMO_VENV / "bin" / "torchrun"
PROBES = REPO / "tests" / "nemo_aligner"
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require_nemo() -> None:
    # install.sh writes the marker last, after the stack imported: a half-built venv skips too
    if not (NEMO_VENV / ".installed").exists():
        pytest.skip(f"needs the NeMo-Aligner stack in {NEMO_VENV}: run ./install.sh nemo "
                    "(./install.sh test installs it too)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    drop = LAUNCH_VARS + ("PYTHONPATH", "VIRTUAL_ENV")
    # One compile thread: megatron-core 0.10's jit_fuser is torch.compile, whose worker pool would
    # otherwise outlive a probe's forked children.
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1",
                                                                    "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def run(cmd: list[str], out: Path, *, timeout: int = 300) -> dict:
    """Runs ``cmd`` (cwd: out's folder) in a session of its own and returns the JSON it wrote to
    ``out``; past ``timeout`` the whole session goes (torchrun's workers, a probe's forks)."""
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} ran past {timeout} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0 and out.exists(), (
        f"{' '.join(map(str, cmd))} failed (rc {proc.returncode}):\n{output[-4000:]}")
    return json.loads(out.read_text())


def torchrun(probe: str, nproc: int, out: Path, *args: str, timeout: int = 300) -> dict:
    """tests/nemo_aligner/<probe> under .venv-nemo's torchrun with ``nproc`` processes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(TORCHRUN), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(PROBES / probe), str(out), *args]
    return run(cmd, out, timeout=timeout)
