"""container/requirements.txt's pinned set resolves for the image's interpreter and platform
(container/resolve_check.py against the package index: slow, and skips without network). The
offline container checks are tests/unit/test_container.py."""

import subprocess
import sys

import pytest

from tests.helpers.container import CHECK, resolve_check

pytestmark = pytest.mark.slow


@pytest.mark.extended  # a check of the pinned set against the package index
def test_requirements_resolve_for_the_image():
    rc = resolve_check()
    out = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=900,
                         check=False)
    if out.returncode == rc.SKIP:
        pytest.skip(next(line for line in out.stdout.splitlines() if line.startswith("SKIP")))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")


def test_pypi_lists_the_dockerfiles_vllm_pin():
    """What container/fetch_sdist.py will check in the build: PyPI's hash for the sdist is the pin."""
    import importlib.util
    import urllib.error

    from tests.helpers.container import DOCKERFILE, ROOT

    spec = importlib.util.spec_from_file_location("fetch_sdist", ROOT / "container" / "fetch_sdist.py")
    fetch_sdist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_sdist)
    args = resolve_check().dockerfile_args(DOCKERFILE)
    try:
        _, listed = fetch_sdist.find_sdist(fetch_sdist.DEFAULT_INDEX, "vllm", args["VLLM_VERSION"])
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"no package index here: {e}")
    assert listed == args["VLLM_SDIST_SHA256"]
