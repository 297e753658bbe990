"""The CPU demo's inputs made once and shared: conf/cpu_tiny.yaml's toy task and warmed-up tiny base
(megatron_dapo/toy/bootstrap.py), copied into the run dirs of the tests that train the demo with
its default toy settings, so that each skips the warm-up.

``make_demo_base`` runs the trainer's own ``materialise`` in a fresh process at the config's thread
count: toy/base.py's weights are bit-identical on the same machine and thread count, so a copied
base is the one the run would have made itself. The session fixture ``demo_base`` (tests/conftest.py)
makes it once per session. A run dir made with other toy settings is refused by the trainer
(bootstrap.check), so a test with other ``toy.*`` or ``seed`` overrides cannot use it by mistake.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU_TINY = ROOT / "conf" / "cpu_tiny.yaml"
DEMO_DIRS = ("toy", "toy_data", "toy_base")
# A child of a launcher (or of an in-process test that set them) must not think it is one rank of many.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")

_MAKE = """
import sys
from pathlib import Path

import torch

from megatron_dapo.config_loading import load_config
from megatron_dapo.toy.bootstrap import materialise

run_dir = Path(sys.argv[2])
cfg = load_config(sys.argv[1], [f"logging.dir={run_dir}", *sys.argv[3:]])
if cfg.num_threads:  # as prepare_run does before it materialises
    torch.set_num_threads(cfg.num_threads)
materialise(cfg, run_dir, rank=0)
"""


def make_demo_base(run_dir: Path, config: Path = CPU_TINY, *overrides: str) -> Path:
    """``run_dir`` with the toy task, base and completion marker of ``config`` (+ ``overrides``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, "-c", _MAKE, str(config), str(run_dir), *overrides], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert all((run_dir / name).is_dir() for name in DEMO_DIRS), sorted(p.name for p in run_dir.iterdir())
    return run_dir


def copy_demo_base(base: Path, run_dir: Path) -> Path:
    """``run_dir`` (made if missing) with ``base``'s toy task and base: a run there skips the warm-up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in DEMO_DIRS:
        shutil.copytree(base / name, run_dir / name)
    return run_dir
