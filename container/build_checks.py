#!/usr/bin/env python3
"""Checks stage 1 of container/Dockerfile runs before it compiles vLLM, each in seconds.

    python build_checks.py constraints --constraints /etc/pip/constraint.txt REQ [REQ ...]
    python build_checks.py jobs --nvcc-threads 4

``constraints``: the NGC base pins every package it ships in its constraint file, and a package it
pins keeps the base's version through the build. vLLM's requirement files (its build and runtime
sets, after ``tools/use_existing_torch.py``) and this package's pyproject.toml (REQ: requirement
files, ``-r`` followed, or a pyproject.toml) may ask for another version of one of them (vLLM 0.33:
``numba == 0.65.0``, ``pillow >= 13``, protobuf outside 6.30-6.33.4, ``setuptools < 81`` to build),
which otherwise fails at the build requirements' install or at ``pip check`` after hours of compiling.
Every requirement whose package the base pins is checked against the pinned version, its markers
evaluated for this interpreter; exit 1 listing each conflict (package, the base's version, the
file and line that wants another), 0 when there is none. Packages the base does not pin are left to
pip (the Dockerfile's dry-run resolve after this check).

``jobs``: MAX_JOBS for vLLM's compile, from the build host's memory: each parallel job runs
``--nvcc-threads`` nvcc threads, and a thread compiling vLLM's sm90 kernels (FlashAttention 3,
CUTLASS) can take several GB (8 jobs x 4 threads exhausted a 64 GB host, a review estimated). So
jobs = available memory / (threads x ``--gb-per-thread``), at least 1, at most the CPUs; the memory
is MemAvailable, or the cgroup's limit when that is lower (``docker build --memory``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tomllib
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name

GB_PER_NVCC_THREAD = 4.0  # an estimate for sm90 kernels (module doc); measure it at the first build


def base_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of every ``name==version`` line of a constraint file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*([^\s;]+)(\s*;.*)?", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def requirements(path: Path, seen: set[Path] | None = None) -> list[tuple[Requirement, str]]:
    """(requirement, "file:line") of a requirement file (``-r`` followed) or a pyproject.toml."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return []
    seen.add(path)
    if path.name == "pyproject.toml":
        deps = tomllib.loads(path.read_text()).get("project", {}).get("dependencies", [])
        return [(Requirement(dep), f"{path}:dependencies") for dep in deps]
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement ")):
            out += requirements(path.parent / line.split(None, 1)[1], seen)
            continue
        if line.startswith("-"):  # -c, --extra-index-url, ...: nothing to check
            continue
        try:
            out.append((Requirement(line), f"{path}:{number}"))
        except InvalidRequirement:  # a URL or a path: pip's to resolve
            continue
    return out


def conflicts(pins: dict[str, str], reqs: list[tuple[Requirement, str]],
              env: dict | None = None) -> list[str]:
    """One line per requirement the base's pinned version does not satisfy (markers evaluated in ``env``)."""
    env = default_environment() if env is None else env
    out = []
    for req, where in reqs:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        have = pins.get(canonicalize_name(req.name))
        if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}: the base pins {have}; {where} wants {req.specifier}")
    return out


def jobs(nvcc_threads: int, gb_per_thread: float = GB_PER_NVCC_THREAD, *,
         meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup/memory.max"),
         cpus: int | None = None) -> int:
    """MAX_JOBS for this host (module doc)."""
    available = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    if cgroup.exists() and cgroup.read_text().strip().isdigit():
        available = min(available, int(cgroup.read_text().strip()))
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(cpus, math.floor(available / 1e9 / (nvcc_threads * gb_per_thread))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("constraints", help="requirement files against the base's pinned versions")
    check.add_argument("--constraints", type=Path, required=True, help="the base's constraint file")
    check.add_argument("files", nargs="+", type=Path, help="requirement files or a pyproject.toml")
    size = sub.add_parser("jobs", help="MAX_JOBS from the host's memory")
    size.add_argument("--nvcc-threads", type=int, required=True)
    size.add_argument("--gb-per-thread", type=float, default=GB_PER_NVCC_THREAD)
    args = parser.parse_args(argv)
    if args.command == "jobs":
        print(jobs(args.nvcc_threads, args.gb_per_thread))
        return 0
    pins = base_pins(args.constraints)
    reqs = [r for path in args.files for r in requirements(path)]
    found = conflicts(pins, reqs)
    if found:
        print(f"build_checks: {len(found)} requirement(s) the base's pinned versions ({args.constraints}) "
              "do not satisfy; pick a base whose versions fit, or another vLLM release:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"build_checks: {len(reqs)} requirements checked against the base's {len(pins)} pins: no conflict")
    return 0


if __name__ == "__main__":
    sys.exit(main())
