"""Transformer Engine is detected as megatron-core sees it (mcore/model.py ``_require_te``).

Each case is a fresh interpreter with a stand-in ``transformer_engine`` package first on the path:
one without ``transformer_engine.pytorch.fp8`` (megatron's own imports fail with a bare
ModuleNotFoundError), one whose ``fp8`` module lacks ``fp8_model_init`` (megatron's TE extension
silently puts a MagicMock in TE's place: ``HAVE_TE = False``). Both must be one ConfigError line.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
from megatron_dapo.errors import ConfigError
from megatron_dapo.mcore.model import _require_te
try:
    _require_te()
    print("ACCEPTED")
except ConfigError as e:
    print("CONFIG_ERROR", e)
"""
FP8_PARTIAL = "class FP8GlobalStateManager: pass\ndef fp8_autocast(*a, **k): pass\n"


def _fake_te(root: Path, fp8_module: str | None) -> Path:
    pkg = root / "transformer_engine"
    (pkg / "pytorch" / "tensor").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '2.9.0'\n")
    (pkg / "pytorch" / "__init__.py").write_text("")
    (pkg / "pytorch" / "tensor" / "__init__.py").write_text("class QuantizedTensor: pass\n")
    if fp8_module is not None:
        (pkg / "pytorch" / "fp8.py").write_text(fp8_module)
    return root


def _probe(path: Path | None) -> str:
    env = {"PYTHONPATH": str(path)} if path else {}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("fp8_module", [None, FP8_PARTIAL], ids=["no_fp8_module", "fp8_module_lacks_a_name"])
def test_a_te_megatron_cannot_use_is_one_config_error(tmp_path, fp8_module):
    line = _probe(_fake_te(tmp_path, fp8_module))
    assert line.startswith("CONFIG_ERROR Transformer Engine is installed, but megatron-core cannot use it"), line
    assert "model.transformer_impl=local" in line


def test_no_te_at_all_names_the_container():
    line = _probe(None)
    assert line.startswith("CONFIG_ERROR model.transformer_impl=transformer_engine (the GPU default) needs "
                           "Transformer Engine"), line
