"""quiet.py: the known-harmless start-up warnings of megatron-core are filtered, and only those.

Fresh interpreters importing what a CPU run imports: without the filter the messages appear (so
the test can fail), with it none of them does, and an unrelated UserWarning still prints."""

import subprocess
import sys

import pytest

from megatron_dapo.quiet import HARMLESS_WARNINGS

IMPORTS = ("from megatron_dapo.mcore.cpu_compat import apply_cpu_compat; apply_cpu_compat(); "
           "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs; "
           "import warnings; warnings.warn('an unrelated warning', UserWarning)")


def _stderr(quiet: bool) -> str:
    code = ("from megatron_dapo.quiet import quiet_start_up; quiet_start_up(); " if quiet else "") + IMPORTS
    # -W default: show DeprecationWarnings too, as pytest does
    return subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300,
                          check=True).stderr


@pytest.mark.slow
def test_harmless_start_up_warnings_are_filtered_and_nothing_else():
    loud, quiet = _stderr(False), _stderr(True)
    assert "Transformer Engine and Apex are not installed" in loud and "Apex is not installed" in loud
    assert "Transformer Engine and Apex" not in quiet and "Apex is not installed" not in quiet
    assert "dynamic_context.py" in loud and "dynamic_context.py" not in quiet
    assert "an unrelated warning" in quiet
    assert all(p.split("\\")[0] not in quiet for p, _ in HARMLESS_WARNINGS)
