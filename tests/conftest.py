"""Shared test set-up: GPU tests skip without CUDA; the extended tier skips unless --extended;
known-harmless third-party start-up messages filtered as at the CLI (megatron_dapo/quiet.py);
megatron-core's CPU compatibility layer applied once for the session (mcore/cpu_compat.py); paths to
the repo's data files; a one-process torch.distributed world; the CPU demo's toy task and warmed-up
base, made once per session; and a summary line for every test outside the slow tier that took a
slow test's time (tests/README.md). Shared helpers (not fixtures) are in tests/helpers/."""

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers.demo import make_demo_base

# The slow marker's threshold (pyproject.toml): a test outside the slow tier that takes longer is
# named in the summary, so that the fast tier does not grow unnoticed.
SLOW_S = 10.0
REPO_ROOT = Path(__file__).resolve().parent.parent
AIME_PARQUET = REPO_ROOT / "data" / "aime-2024.parquet"


def pytest_configure(config):
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
    from megatron_dapo.quiet import quiet_start_up

    quiet_start_up()
    apply_cpu_compat()  # megatron-core on a machine without CUDA; a no-op with CUDA (docs/cpu_compat.md)


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (tests marked extended; tests/README.md)")


def pytest_collection_modifyitems(config, items):
    # The extended tier (checks of pinned upstreams, long runs whose property a CI test also asserts)
    # is skipped, with its reason in the summary, so that the suite fits CI's time (tests/README.md).
    extended = config.getoption("--extended")  # or PYTEST_ADDOPTS=--extended
    skip_extended = pytest.mark.skip(reason="extended tier: run with --extended (tests/README.md)")
    skip_gpu = pytest.mark.skip(reason="needs CUDA (GPU-marked test)")
    cuda = torch.cuda.is_available()
    for item in items:
        if "extended" in item.keywords and not extended:
            item.add_marker(skip_extended)
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)


_durations: dict[str, float] = {}
_unmarked_slow: set[str] = set()


def pytest_runtest_logreport(report):
    # setup counts too: a module fixture's training run is paid by the first test that asks for it
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown" and "slow" not in report.keywords and _durations[report.nodeid] > SLOW_S:
        _unmarked_slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.write_sep("=", f"not marked slow, over {SLOW_S:.0f} s (mark them slow: tests/README.md)")
        for nodeid in sorted(_unmarked_slow, key=lambda n: -_durations[n]):
            terminalreporter.write_line(f"{_durations[nodeid]:7.1f} s  {nodeid}")


_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def launcher_env_restored():
    """torchrun's variables put back as they were after each module: an in-process world or engine
    that sets some of them (vLLM's in-process start sets RANK and WORLD_SIZE, not MASTER_ADDR) would
    make a later module's launcher-less subprocess believe it runs under torchrun."""
    before = {key: os.environ.get(key) for key in _LAUNCHER_VARS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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


@pytest.fixture
def world_of_one(world_of_one_env):
    """A world of one for code that starts torch.distributed itself (MegatronActor); megatron's
    groups and the process group are torn down after the test."""
    yield
    from megatron_dapo.mcore import destroy_parallel

    destroy_parallel()


@pytest.fixture(scope="session")
def demo_base(tmp_path_factory) -> Path:
    """A run dir holding conf/cpu_tiny.yaml's toy task, warmed-up base and completion marker, made
    once per session; tests.helpers.demo.copy_demo_base copies it into a test's run dir, where a run
    with the default toy settings skips the warm-up (any other toy.* / seed is refused there)."""
    return make_demo_base(tmp_path_factory.mktemp("demo_base"))


@pytest.fixture(scope="session")
def demo_reference(demo_base, tmp_path_factory) -> Path:
    """One uninterrupted run of tests.helpers.demo_runs' command, made once per session: the fault
    and resume tests compare their interrupted runs' records with it."""
    from tests.helpers.demo_runs import make_reference

    return make_reference(demo_base, tmp_path_factory.mktemp("reference"))
