"""Shared test set-up: GPU tests skip without CUDA; known-harmless third-party start-up messages
filtered as at the CLI (megatron_dapo/quiet.py); megatron-core's CPU compatibility layer applied
once for the session (policy/cpu_compat.py); paths to the repo's data files; the environment of a
one-process torch.distributed world."""

import socket
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
AIME_PARQUET = REPO_ROOT / "data" / "aime-2024.parquet"


def pytest_configure(config):
    from megatron_dapo.policy.cpu_compat import apply_cpu_compat
    from megatron_dapo.quiet import quiet_start_up

    quiet_start_up()
    apply_cpu_compat()  # megatron-core on a machine without CUDA; a no-op with CUDA (docs/cpu_compat.md)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (GPU-marked test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def aime_path() -> Path:
    return AIME_PARQUET


@pytest.fixture
def world_of_one_env(monkeypatch):
    """torch.distributed's variables for a world of one on a free local port; the test starts (and
    its own fixture ends) the world."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
