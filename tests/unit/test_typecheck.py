"""mypy passes over the files pyproject.toml's [tool.mypy] names: among them, both rollout placements
checked against their protocol (rollout/placements.py ``_conforms``: a member whose parameters, types,
defaults or return type differ from ``Placement``'s fails here, the member named)."""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_passes_with_the_projects_config():
    if importlib.util.find_spec("mypy") is None:  # ./install.sh test installs it (CI); the GPU image has none
        pytest.skip("mypy is not installed: ./install.sh test installs it")
    with tempfile.TemporaryDirectory() as cache:  # a cold run: no stale cache can hide an error
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", cache],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"mypy (pyproject.toml [tool.mypy]):\n{out.stdout[-8000:]}{out.stderr[-2000:]}"
