"""container/requirements.txt's pinned set resolves for the image's interpreter and platform
(container/resolve_check.py against the package index: slow, and skips without network). The
offline container checks are tests/unit/test_container.py."""

import subprocess
import sys

import pytest

from tests.helpers.container import CHECK, resolve_check

pytestmark = pytest.mark.slow


def test_requirements_resolve_for_the_image():
    rc = resolve_check()
    out = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=900,
                         check=False)
    if out.returncode == rc.SKIP:
        pytest.skip(next(line for line in out.stdout.splitlines() if line.startswith("SKIP")))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")
