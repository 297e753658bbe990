"""The import-time half of cpu_compat.py: a ``triton`` stub and an identity ``torch.compile``, in place
only while ``import megatron.core`` runs (``import_window``; cpu_compat.py's design notes say why).
Nothing here patches anything until cpu_compat.apply_cpu_compat opens the window."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types

import torch


class _TritonStub(types.ModuleType):
    """Every attribute is a placeholder, enough for ``@triton.jit`` / ``tl.constexpr`` at import
    time. ``__version__`` 0.0.0 makes version-gated modules (fusions/fused_indices_converter.py)
    conclude that triton is absent."""

    def __getattr__(self, name):
        if name.startswith("__"):  # inspect and importlib ask for dunders: answer like a module
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")


class _Absent:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):  # decorators and their factories
        return _Absent(self._name + "(...)")

    def __getitem__(self, grid):  # kernel[grid](...) launches
        raise RuntimeError(f"{self._name}: triton kernels cannot run on CPU (megatron_dapo stub)")


@contextlib.contextmanager
def import_window(stub: bool, compile_identity: bool):
    installed = {}
    if stub and importlib.util.find_spec("triton") is None:
        # Fix torch's cached "is triton installed?" answers at False before the stub exists, so
        # nothing that asks during the import window is misled.
        from torch.utils import _triton
        _triton.has_triton_package(), _triton.has_triton()
        for name in ("triton", "triton.language"):
            installed[name] = _TritonStub(name)
            installed[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
            installed[name].__version__ = "0.0.0"
        installed["triton"].language = installed["triton.language"]
        sys.modules.update(installed)
    original_compile = torch.compile
    if compile_identity:
        torch.compile = _identity_compile
    try:
        yield
    finally:
        torch.compile = original_compile
        for name in installed:
            sys.modules.pop(name, None)


def _identity_compile(model=None, *args, **kwargs):
    """torch.compile(fn) and torch.compile(**options)(fn) both return fn."""
    return model if model is not None else (lambda fn: fn)


def probe_import():
    import megatron.core.jit

    def f():
        pass
    assert megatron.core.jit.jit_fuser(f) is f, "megatron's jit_fuser should be the identity on CPU"
    assert not isinstance(sys.modules.get("triton"), _TritonStub), "the stub must not outlive the import"
