"""container/build_checks.py, stage 1's checks before vLLM's compile: requirement files (vLLM's layout:
requirements/cuda.txt including common.txt, requirements/build/cuda.txt; this package's
pyproject.toml) against an NGC-style constraint file, one that conflicts and one that does not, with
markers evaluated; MAX_JOBS from a host's memory; and the Dockerfile running both before the compile.
Against vLLM 0.33.0's own requirement files: tests/functional/test_container_resolve.py (extended)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.helpers.container import DOCKERFILE, ROOT

CHECKS = ROOT / "container" / "build_checks.py"
spec = importlib.util.spec_from_file_location("build_checks", CHECKS)
bc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bc)


@pytest.fixture
def vllm_tree(tmp_path) -> Path:
    """Requirement files laid out as vLLM's sdist lays them out, after use_existing_torch.py."""
    req = tmp_path / "requirements"
    (req / "build").mkdir(parents=True)
    (req / "common.txt").write_text("# shared by every device\nregex\n"
                                    "numba == 0.65.0 # JIT for n-gram spec decode\n"
                                    "pillow >= 13.0.0\nprotobuf >= 5.29.6, !=6.30.*, !=6.31.*, !=6.32.*, "
                                    "!=6.33.0.*, !=6.33.1.*, !=6.33.2.*, !=6.33.3.*, !=6.33.4.*\n"
                                    "pywin32 == 306; sys_platform == 'win32'\n")
    (req / "cuda.txt").write_text("-r common.txt\n\nray[cgraph] >= 2.48.0\n")
    (req / "build" / "cuda.txt").write_text("cmake>=3.26.1\nninja\nsetuptools>=78.1.1,<81.0.0\nwheel\n")
    return tmp_path


def _constraints(tmp_path: Path, **pins: str) -> Path:
    path = tmp_path / "constraint.txt"
    path.write_text("".join(f"{name.replace('_', '-')}=={version}\n" for name, version in pins.items()))
    return path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKS), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_a_base_whose_pins_conflict_is_refused_naming_each_package_and_the_line(vllm_tree, tmp_path):
    base = _constraints(tmp_path, numba="0.61.2", pillow="11.3.0", protobuf="6.31.1", setuptools="82.0.1",
                        transformers="4.48.0", regex="2024.11.6", pywin32="300", ray="2.47.0")
    out = _run("constraints", "--constraints", base, vllm_tree / "requirements/build/cuda.txt",
               vllm_tree / "requirements/cuda.txt", ROOT / "pyproject.toml")
    assert out.returncode == 1, out.stdout + out.stderr
    found = {}
    for line in out.stderr.splitlines()[1:]:
        parts = re.fullmatch(r"\s*(\S+): the base pins (\S+); (\S+) wants (\S+)", line)
        name, have, where, wants = parts.groups()
        found[name] = (have, where, SpecifierSet(wants))
    req = vllm_tree / "requirements"
    assert found == {  # pywin32's marker is false here; regex is not constrained
        "numba": ("0.61.2", f"{req / 'common.txt'}:3", SpecifierSet("==0.65.0")),
        "pillow": ("11.3.0", f"{req / 'common.txt'}:4", SpecifierSet(">=13.0.0")),
        "protobuf": ("6.31.1", f"{req / 'common.txt'}:5",
                     SpecifierSet((req / "common.txt").read_text().splitlines()[4].split("protobuf", 1)[1])),
        "setuptools": ("82.0.1", f"{req / 'build/cuda.txt'}:3", SpecifierSet(">=78.1.1,<81.0.0")),
        "ray": ("2.47.0", f"{req / 'cuda.txt'}:3", SpecifierSet(">=2.48.0")),
        "transformers": ("4.48.0", f"{ROOT / 'pyproject.toml'}:dependencies", SpecifierSet(">=4.51")),
    }


def test_a_base_whose_pins_fit_passes(vllm_tree, tmp_path):
    base = _constraints(tmp_path, numba="0.65.0", pillow="13.0.0", protobuf="6.33.5", setuptools="80.9.0",
                        transformers="5.16.1", torch="2.14.0a0+b2c75dd062")
    out = _run("constraints", "--constraints", base, vllm_tree / "requirements/build/cuda.txt",
               vllm_tree / "requirements/cuda.txt", ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stderr
    assert "no conflict" in out.stdout


def test_jobs_fit_the_hosts_memory_and_cpus(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {70_000_000} kB\nMemAvailable: {64_000_000_000 // 1024} kB\n")
    none = tmp_path / "no-cgroup"
    assert bc.jobs(4, meminfo=meminfo, cgroup=none, cpus=64) == 4  # 64 GB / (4 threads x 4 GB)
    limit = tmp_path / "memory.max"
    limit.write_text("32000000000\n")
    assert bc.jobs(4, meminfo=meminfo, cgroup=limit, cpus=64) == 2  # docker build --memory 32g
    limit.write_text("max\n")
    assert bc.jobs(4, meminfo=meminfo, cgroup=limit, cpus=3) == 3  # no limit; the CPUs bound it
    assert bc.jobs(16, meminfo=meminfo, cgroup=none, cpus=64) == 1  # never 0
    assert _run("jobs", "--nvcc-threads", "4").stdout.strip().isdigit()


def test_the_dockerfile_checks_before_it_installs_or_compiles():
    stage1 = DOCKERFILE.read_text().split("# ---- stage 2")[0]
    order = [stage1.index(s) for s in ("build_checks.py constraints", "pip install --dry-run",
                                       "pip install --no-cache-dir -r requirements/build/cuda.txt",
                                       "$(python /opt/build_checks.py jobs", "pip wheel")]
    assert order == sorted(order)
    assert 'ARG MAX_JOBS=""' in stage1 and 'MAX_JOBS="${jobs}"' in stage1
