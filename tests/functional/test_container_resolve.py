"""container/requirements.txt's pinned set resolves for the image's interpreter and platform
(container/resolve_check.py against the package index: slow, and skips without network), and
stage 1's early check (container/build_checks.py) reads vLLM 0.33.0's own requirement files. The
offline container checks are tests/unit/test_container.py and test_container_build_checks.py."""

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


@pytest.mark.extended  # a check of the pinned vLLM's own requirement files (a 47 MB download)
def test_vllm_s_requirements_against_a_base_that_conflicts_and_one_that_fits(tmp_path):
    """Stage 1's constraints check on vLLM 0.33.0's sdist after tools/use_existing_torch.py, as the
    Dockerfile runs it: a base pinning numba 0.61.2, pillow 11.3.0, protobuf 6.31.1 and setuptools
    82.0.1 (the kinds of pins an NGC base carries) is refused naming each; one at versions vLLM
    accepts passes."""
    import importlib.util
    import tarfile
    import urllib.error

    from tests.helpers.container import DOCKERFILE, ROOT

    spec = importlib.util.spec_from_file_location("fetch_sdist", ROOT / "container" / "fetch_sdist.py")
    fetch_sdist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_sdist)
    args = resolve_check().dockerfile_args(DOCKERFILE)
    sdist = tmp_path / "vllm.tar.gz"
    fetch = [sys.executable, str(ROOT / "container" / "fetch_sdist.py"), "vllm", args["VLLM_VERSION"],
             args["VLLM_SDIST_SHA256"], str(sdist)]
    try:
        fetch_sdist.find_sdist(fetch_sdist.DEFAULT_INDEX, "vllm", args["VLLM_VERSION"])
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"no package index here: {e}")
    subprocess.run(fetch, check=True, capture_output=True, timeout=900)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/requirements/" in m.name or m.name.endswith(
            ("/tools/use_existing_torch.py", "/pyproject.toml")) and m.name.count("/") <= 2]
        tar.extractall(tmp_path, members=members, filter="data")
    tree = next(tmp_path.glob("vllm-*"))
    subprocess.run([sys.executable, "tools/use_existing_torch.py"], cwd=tree, check=True, capture_output=True)
    files = [tree / "requirements/build/cuda.txt", tree / "requirements/cuda.txt", ROOT / "pyproject.toml"]

    def check(**pins) -> subprocess.CompletedProcess:
        base = tmp_path / "constraint.txt"
        base.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
        return subprocess.run([sys.executable, str(ROOT / "container" / "build_checks.py"), "constraints",
                               "--constraints", str(base), *map(str, files)], capture_output=True, text=True)

    out = check(numba="0.61.2", pillow="11.3.0", protobuf="6.31.1", setuptools="82.0.1")
    assert out.returncode == 1
    named = {line.split(":")[0].strip() for line in out.stderr.splitlines()[1:]}
    assert named == {"numba", "pillow", "protobuf", "setuptools"}, out.stderr
    out = check(numba="0.65.0", pillow="13.0.0", protobuf="6.33.5", setuptools="80.9.0")
    assert out.returncode == 0 and "no conflict" in out.stdout, out.stderr
