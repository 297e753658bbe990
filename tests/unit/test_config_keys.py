"""No phantom settings: every leaf key of the config schema is read by the code it configures.

Rule, per leaf ``section.name`` (``algorithm.filter_groups.enable``: section ``filter_groups``): some
module of the package other than config.py / config_loading.py (where validation and loading do not
count as reading) both

* reads the attribute ``.name`` (``x.name`` in load context, or ``getattr(x, "name")``), and
* refers to the section: an attribute access ``.section``, or the section's class name
  (``RolloutConfig``; a parameter annotation or a docstring naming the type of an ``Any`` parameter).

Top-level keys (``seed``) need ``.seed`` in a module that names ``DAPOConfig``. The rule is per file,
so it can be fooled by an unrelated ``.name`` next to the section, but it catches a key that nothing
reads at all, which is what a phantom setting is.
"""

import ast
import re
from pathlib import Path

from megatron_dapo.config import DAPOConfig
from tests.helpers.config_fields import leaves

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dapo"
NOT_READERS = {"config.py", "config_loading.py"}

# Keys read only indirectly, not as ``.name``; each with the reason. Keep this short.
ALLOWLIST: dict[str, str] = {}


def _scan(path: Path) -> tuple[set[str], str]:
    """(attribute names read in the module, its source)."""
    source = path.read_text()
    read = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            read.add(node.args[1].value)
    return read, source


def _modules() -> dict[str, tuple[set[str], str]]:
    return {str(p.relative_to(PACKAGE.parent)): _scan(p) for p in sorted(PACKAGE.rglob("*.py"))
            if p.name not in NOT_READERS}


def unread_keys() -> list[str]:
    modules = _modules()
    unread = []
    for key, section, cls_name in leaves(DAPOConfig):
        name = key.rsplit(".", 1)[-1]
        refers = re.compile(rf"\b{cls_name}\b" + (rf"|\.{section}\b" if section else ""))
        if not any(name in read and refers.search(source) for read, source in modules.values()):
            unread.append(key)
    return unread


def test_schema_walk_sees_every_leaf():
    keys = [k for k, _, _ in leaves(DAPOConfig)]
    assert {"seed", "rollout.n", "algorithm.filter_groups.enable", "reward.overlong_buffer.len"} <= set(keys)
    assert len(keys) == len(set(keys))


def test_every_config_key_is_read():
    unread = [k for k in unread_keys() if k not in ALLOWLIST]
    msg = "\n".join(f"  {k}: no module outside config.py/config_loading.py reads it: wire it, or remove it "
                    f"from megatron_dapo/config.py (and regenerate conf/base.yaml)" for k in unread)
    assert not unread, f"phantom config keys (nothing reads them):\n{msg}"


def test_allowlist_is_not_stale():
    keys = {k for k, _, _ in leaves(DAPOConfig)}
    unread = set(unread_keys())
    stale = [k for k in ALLOWLIST if k not in keys or k not in unread]
    assert not stale, f"allowlisted keys that no longer exist or are now read directly; drop them: {stale}"
