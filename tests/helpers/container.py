"""container/'s files and its resolve checker (container/resolve_check.py, a script, loaded as a
module) for the container tests: tests/unit/test_container.py (offline) and
tests/functional/test_container_resolve.py (needs PyPI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "container" / "Dockerfile"
REQUIREMENTS = ROOT / "container" / "requirements.txt"
README = ROOT / "container" / "README.md"
CHECK = ROOT / "container" / "resolve_check.py"


def resolve_check():
    """container/resolve_check.py as a module."""
    spec = importlib.util.spec_from_file_location("resolve_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
