"""The checks that keep cpu_compat.py honest: every patch is NEEDED (its megatron call fails without
it, with the error its ``expect`` names) and together they are ENOUGH (every probe passes).

Patches act on the whole process and two of them on ``import megatron.core`` itself, so each check
runs in a fresh interpreter (tests/unit/test_policy_cpu_compat.py starts them):

    python -m megatron_dapo.mcore.cpu_compat_check --all         # ENOUGH, then NEEDED per run-time patch
    python -m megatron_dapo.mcore.cpu_compat_check triton_stub   # NEEDED for one import-time patch

Importing the package applies nothing, so the interpreter starts unpatched.
"""

from __future__ import annotations

import json
import sys

from megatron_dapo.mcore.cpu_compat import _IMPORT_TIME, PATCHES, Patch, _apply, _undo, apply_cpu_compat


def _expect_failure(patch: Patch) -> str:
    try:
        patch.probe()
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        message = f"{type(e).__name__}: {e}"
        assert patch.expect in message, f"{patch.name}: probe failed differently: {message}"
        return message
    raise AssertionError(f"{patch.name}: probe passed without the patch; the patch may be obsolete")


def check_needed(name: str) -> str:
    """Fresh process only: apply all patches but ``name`` and run its probe. Returns the error
    message when it fails as ``expect`` says; raises AssertionError otherwise."""
    patch = PATCHES[name]
    try:
        apply_cpu_compat(skip=[name])
    except Exception as e:  # noqa: BLE001 (an import-time patch: the import itself fails)
        message = f"{type(e).__name__}: {e}"
        assert patch.expect in message, f"{name}: failed differently: {message}"
        return message
    return _expect_failure(patch)


def check_all() -> dict[str, str]:
    """Fresh process only: apply everything and run every probe (ENOUGH); then undo each
    run-time patch in turn, expect its probe to fail (NEEDED) and re-apply it. The import-time
    patches cannot be undone; check them with check_needed in their own processes.
    Returns {patch name: the failure without it}."""
    apply_cpu_compat()
    for patch in PATCHES.values():
        patch.probe()
    needed = {}
    for name, patch in PATCHES.items():
        if name in _IMPORT_TIME:
            continue
        _undo(name)
        try:
            needed[name] = _expect_failure(patch)
        finally:
            _apply(patch)
    for patch in PATCHES.values():  # and everything still works after the re-applies
        patch.probe()
    return needed



if __name__ == "__main__":
    target = sys.argv[1]
    if target == "--all":
        print("ENOUGH+NEEDED " + json.dumps(check_all()))
    else:
        print(f"NEEDED: {check_needed(target)}")
