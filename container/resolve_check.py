#!/usr/bin/env python3
"""Resolve container/requirements.txt for the image's platform, without installing anything.

The image (container/Dockerfile) installs container/requirements.txt with --no-deps on top of an NGC
PyTorch base, so the file must be a complete, consistent closure for that base's interpreter. This
runs `pip install --dry-run --report` for CPython <BASE_PYTHON> on manylinux x86_64 (glibc
<BASE_GLIBC> down to 2.17), wheels only, with the Dockerfile's megatron-core pin added, and with a
metadata-only stand-in for the base's torch: version <BASE_TORCH>.0a0+base, a pre-release like the
base's own (NGC ships 2.x.0a0+<commit>), so any requirement such as `torch==2.14.0` fails here as it
would in the image. BASE_* and the pins come from container/Dockerfile's ARGs.

Exit status: 0 resolved and closed, 1 not (the reason is printed), 3 SKIP (the index cannot be
reached: nothing was checked). Local pip configuration (this machine's constraint file, find-links,
extra indexes) is ignored; only the index given by --index-url is used.

    python container/resolve_check.py                  # check container/requirements.txt
    python container/resolve_check.py --compile DIR/requirements/cuda.txt > container/requirements.txt
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "container" / "Dockerfile"
REQUIREMENTS = ROOT / "container" / "requirements.txt"
SKIP = 3
# The base's own CUDA stack: never pinned in requirements.txt, never installed by the image.
BASE_STACK = ("torch", "torchvision", "torchaudio", "torchcodec", "triton", "transformer-engine",
              "transformer-engine-cu12", "transformer-engine-cu13", "transformer-engine-torch", "apex")
# Of those, what the set may depend on: torch gets the stand-in; triton (only ever required without a
# version bound so far) resolves from the index and is reported, not pinned.
BASE_DEPENDED_ON = ("torch", "triton")
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "ConnectTimeout", "Could not fetch URL", "Network is unreachable", "Connection refused")
# pip evaluates environment markers for the interpreter it runs on, whatever --python-version says,
# and older pips (23.2 here) check Requires-Python against it too; this runner gives pip the image's
# marker environment and Python version before it starts (through pip's vendored packaging and its
# resolver's candidate for the running Python).
RUNNER = """\
import json, sys
import pip._vendor.packaging.markers as markers
env = dict(markers.default_environment(), **json.loads(sys.argv[1]))
markers.default_environment = lambda: dict(env)
from pip._internal.resolution.resolvelib import candidates
init = candidates.RequiresPythonCandidate.__init__
target = tuple(int(x) for x in env["python_version"].split("."))
candidates.RequiresPythonCandidate.__init__ = lambda self, info: init(self, info or target)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def dockerfile_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """Default value of every `ARG NAME=value` in the Dockerfile (first one wins)."""
    args = {}
    for name, value in re.findall(r"^ARG\s+(\w+)=(\S+)", path.read_text(), re.MULTILINE):
        args.setdefault(name, value.strip("\"'"))
    return args


def parse_pins(path: Path) -> dict[str, tuple[str, str]]:
    """{canonical name: (name, version)} of a requirements file; ValueError on any line that is not
    `name==version`, on a duplicate, or on a package of the base's CUDA stack."""
    pins = {}
    for num, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)", line)
        if m is None:
            raise ValueError(f"{path.name}:{num}: not a `name==version` pin: {raw!r}")
        key = canonicalize_name(m[1])
        if key in BASE_STACK:
            raise ValueError(f"{path.name}:{num}: {m[1]} belongs to the base image and must not be installed")
        if key in pins:
            raise ValueError(f"{path.name}:{num}: {m[1]} is pinned twice")
        pins[key] = (m[1], m[2])
    return pins


def target(args: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """pip's platform options and the marker environment of the image."""
    py, glibc = args["BASE_PYTHON"], int(args["BASE_GLIBC"].split(".")[1])
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(glibc, 16, -1)] + ["manylinux2014_x86_64"]
    options = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp",
               "--abi", f"cp{py.replace('.', '')}", "--abi", "abi3", "--abi", "none"]
    for p in platforms:
        options += ["--platform", p]
    env = {"python_version": py, "python_full_version": f"{py}.0", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    return options, env


def torch_stand_in(folder: Path, version: str) -> None:
    """A metadata-only torch wheel (no files, no dependencies) for pip to resolve against."""
    dist = f"torch-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{dist}/WHEEL": ("Wheel-Version: 1.0\nGenerator: resolve_check\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n"),
             f"{dist}/RECORD": ""}
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)


def reachable(index_url: str) -> str | None:
    """None when the index answers, else why not."""
    try:
        with urllib.request.urlopen(index_url.rstrip("/") + "/pip/", timeout=20) as reply:
            reply.read(1)
        return None
    except OSError as err:  # URLError, timeouts, TLS failures
        return str(getattr(err, "reason", err))


def resolve(requirement_args: list[str], index_url: str, args: dict[str, str]) -> tuple[dict | None, str]:
    """Run pip's dry run; (report, '') or (None, pip's output)."""
    options, env = target(args)
    stand_in = f"{args['BASE_TORCH']}.0a0+base"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "stand-ins").mkdir()
        torch_stand_in(tmp / "stand-ins", stand_in)
        (tmp / "constraints.txt").write_text(f"torch=={stand_in}\n")
        pip_args = ["install", "--dry-run", "--ignore-installed", "--target", str(tmp / "target"),
                    "--report", str(tmp / "report.json"), "--quiet", "--progress-bar", "off",
                    "--disable-pip-version-check", "--no-input", "--timeout", "30",
                    "--index-url", index_url, "--find-links", str(tmp / "stand-ins"),
                    # metadata through HTTP range requests instead of whole wheels (this index
                    # serves no separate metadata files)
                    "--use-feature=fast-deps",
                    "--constraint", str(tmp / "constraints.txt"), *options, *requirement_args]
        keep = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST")  # transport settings only
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
        environ["PIP_CONFIG_FILE"] = os.devnull
        proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(env), *pip_args], env=environ,
                              capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            return None, proc.stdout + proc.stderr
        return json.loads((tmp / "report.json").read_text()), ""


def base_requirements(report: dict, env: dict[str, str]) -> dict[str, list[str]]:
    """{base package: ['requirer (specifier)', ...]} over the resolved set, markers evaluated."""
    found = {name: [] for name in BASE_DEPENDED_ON}
    for item in report["install"]:
        meta, extras = item["metadata"], item.get("requested_extras") or []
        for text in meta.get("requires_dist") or []:
            req = Requirement(text)
            key = canonicalize_name(req.name)
            if key not in found:
                continue
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in ["", *extras]):
                continue
            found[key].append(f"{meta['name']} ({req.specifier or 'any'})")
    return found


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a pip requirements file, its `-r` includes expanded, comments dropped."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line.startswith("-r "):
            lines += requirement_lines(path.parent / line[3:].strip())
        elif line and not line.startswith(("#", "-")):
            lines.append(line)
    return lines


def recorded_requires(path: Path) -> list[str]:
    """The `#   requires: ...` lines of a requirements.txt header (vLLM's own requirements)."""
    return re.findall(r"^#   requires: (.+)$", path.read_text(), re.MULTILINE)


def our_inputs() -> list[str]:
    """This package's own runtime, logging and test requirements (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *extras.get("log", []), *extras.get("test", [])]


def report_check(report: dict, pins: dict, mcore: str, env: dict[str, str], seconds: float,
                 name: str) -> int:
    """Print what resolved and what it asks of the base; 1 if the pinned set is not closed."""
    resolved = {canonicalize_name(i["metadata"]["name"]): (i["metadata"]["name"], i["metadata"]["version"])
                for i in report["install"]}
    unpinned = sorted(f"{n}=={v}" for k, (n, v) in resolved.items()
                      if k not in pins and k not in BASE_DEPENDED_ON and k != "megatron-core")
    base = ", ".join(f"{k} {resolved[k][1]}" for k in BASE_DEPENDED_ON if k in resolved)
    print(f"resolved {len(resolved)} packages in {seconds:.0f} s: {len(pins)} pinned in {name}, {mcore} "
          f"(Dockerfile), and the base's own {base} (torch: the stand-in; triton: the index's, not pinned)")
    print(textwrap.fill(" ".join(f"{n}=={v}" for k, (n, v) in sorted(resolved.items()) if k in pins),
                        width=110, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    print("what the set requires of the base's packages:")
    for key, needs in base_requirements(report, env).items():
        print(textwrap.fill(f"{key}: " + (", ".join(needs) or "nothing"), width=110,
                            initial_indent="  ", subsequent_indent="    "))
    if unpinned:
        print(f"FAIL: resolved but not pinned (the image installs with --no-deps, so these would be "
              f"missing): {', '.join(unpinned)}")
        return 1
    print("OK")
    return 0


def print_compiled(report: dict, requires: list[str], vllm: str) -> int:
    """Print a new requirements.txt: the header, then every resolved pin but the base's and megatron-core."""
    pins = sorted((canonicalize_name(i["metadata"]["name"]), i["metadata"]["name"], i["metadata"]["version"])
                  for i in report["install"])
    ours = textwrap.fill("; ".join(our_inputs()), width=100, initial_indent="#   ", subsequent_indent="#   ",
                         break_on_hyphens=False)
    print(HEADER.format(vllm=vllm, ours=ours, requires="\n".join(f"#   requires: {r}" for r in requires)))
    print("\n".join(f"{name}=={version}" for key, name, version in pins
                    if key not in BASE_DEPENDED_ON and key != "megatron-core"))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS, help="the pinned file to check")
    parser.add_argument("--index-url", default="https://pypi.org/simple", help="the package index (PyPI)")
    parser.add_argument("--compile", nargs="+", metavar="INPUT",
                        help="instead of checking: resolve these requirement files or specs, plus this "
                             "package's own (pyproject.toml: dependencies, extras log and test), and print a "
                             "new requirements.txt")
    opts = parser.parse_args(argv)
    args = dockerfile_args()
    mcore = f"megatron-core=={args['MEGATRON_CORE_VERSION']}"
    # in --compile mode stdout is the new file: everything else goes to stderr
    say = (lambda *a: print(*a, file=sys.stderr)) if opts.compile else print
    if opts.compile:
        # vLLM's requirement lines are recorded in the header, so that every check resolves them too
        requires = [line for x in opts.compile
                    for line in (requirement_lines(Path(x)) if Path(x).is_file() else [x])]
        requirement_args = [*our_inputs(), mcore, *requires]
    else:
        try:
            pins = parse_pins(opts.requirements)
        except ValueError as err:
            say(f"FAIL: {err}")
            return 1
        requires = recorded_requires(opts.requirements)
        if not requires:
            say(f"FAIL: {opts.requirements.name} records no `#   requires:` lines (vLLM's requirements)")
            return 1
        # the pins, plus what must hold of them: vLLM's, megatron-core's and this package's requirements
        requirement_args = ["-r", str(opts.requirements), mcore, *our_inputs(), *requires]
    say(f"resolve_check: {'compiling' if opts.compile else opts.requirements.name} for CPython "
        f"{args['BASE_PYTHON']}, manylinux_2_{args['BASE_GLIBC'].split('.')[1]}..2_17 x86_64, "
        f"torch {args['BASE_TORCH']} from the base")
    why = reachable(opts.index_url)
    if why is not None:
        say(f"SKIP: the package index {opts.index_url} cannot be reached ({why}); nothing was checked")
        return SKIP
    start = time.monotonic()
    report, output = resolve(requirement_args, opts.index_url, args)
    seconds = time.monotonic() - start
    if report is None:
        if any(marker in output for marker in NETWORK_ERRORS):
            say(f"SKIP: the index stopped answering during the resolve; nothing was checked\n"
                f"{output[-2000:]}")
            return SKIP
        say(f"FAIL: pip could not resolve the set ({seconds:.0f} s):\n{output[-4000:]}")
        return 1
    if opts.compile:
        say(f"resolve_check: {len(report['install'])} packages resolved in {seconds:.0f} s")
        return print_compiled(report, requires, args["VLLM_VERSION"])
    return report_check(report, pins, mcore, target(args)[1], seconds, opts.requirements.name)


HEADER = """\
# Python packages container/Dockerfile installs on top of the NGC PyTorch base, pinned for its
# CPython 3.12 on manylinux x86_64. The image installs them with --no-deps after dropping every name
# the base's /etc/pip/constraint.txt pins (the base's version wins), then runs `pip check`.
#
# GENERATED by `python container/resolve_check.py --compile ...`: do not edit by hand. It is the
# resolve, on PyPI, of vLLM {vllm}'s requirements (the `requires:` lines below: its
# requirements/cuda.txt with common.txt, after vLLM's tools/use_existing_torch.py removed the torch,
# torchvision, torchaudio and torchcodec lines, as the image build does), of the Dockerfile's
# megatron-core pin (installed by the Dockerfile itself, so not listed), and of this package's
# dependencies and extras `log` and `test` (pyproject.toml), at the time of writing:
{ours}
# against a stand-in for the base's torch (a 2.x.0a0 pre-release, as NGC ships). The base's own
# packages (torch, triton, Transformer Engine, apex) are never listed. `python
# container/resolve_check.py` resolves the pins together with all of these requirements (this
# package's read afresh from pyproject.toml) and fails if anything resolves that is not pinned.
#
# Refresh (after changing VLLM_VERSION, MEGATRON_CORE_VERSION or our dependencies):
#   1. python container/fetch_sdist.py vllm <VLLM_VERSION> <VLLM_SDIST_SHA256> vllm.tar.gz,
#      unpack it and run `python tools/use_existing_torch.py` inside it;
#   2. python container/resolve_check.py --compile <vllm>/requirements/cuda.txt > container/requirements.txt
#   3. python container/resolve_check.py   (checks the new file; tests/unit/test_container.py runs it)
#
# vLLM {vllm}'s requirements:
{requires}
"""

if __name__ == "__main__":
    sys.exit(main())
