"""actor.offload_during_rollout in the real loop (the CPU demo, one process): the state goes off before
the engine is built, before every step's rollouts and every evaluation, and comes back before the old
log-probs, the weight sync and the saves. The reference is the same run without it: every metric
but the timings and the offload's own, and every checkpoint file, byte for byte. The actor-level
bitwise tests (the move is real: storages of size 0) are tests/unit/test_offload.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.metrics_log import read_metrics
from tests.helpers.demo import CPU_TINY, LAUNCHER_VARS, copy_demo_base

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ARGS = ["train.total_steps=2", "eval.every=1", "eval.before_train=true", "checkpoint.save_every=1",
        "logging.tensorboard=false", "logging.samples_every=0"]


def _train(run_dir: Path, *extra: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CPU_TINY),
                          f"logging.dir={run_dir}", *ARGS, *extra], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return read_metrics(run_dir / "metrics.jsonl")


def _comparable(records: list[dict]) -> list[dict]:
    skip = ("time", "actor/offloaded_gb")
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/") and k not in skip} for r in records]


def _checkpoint_bytes(run_dir: Path) -> dict[str, object]:
    """Every checkpoint file's bytes (the tensors, the common state), less the two that name the run's
    own directory (torch's .metadata, our checkpoint.json manifest); the trainer state less its step
    clock (measured seconds); torch's RNG state."""
    root, out = run_dir / "checkpoints", {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in (".metadata", "checkpoint.json"):
            out[str(p.relative_to(root))] = p.read_bytes()
            if p.name == "trainer_state.json":
                out[str(p.relative_to(root))] = {k: v for k, v in json.loads(p.read_text()).items() if k != "clock"}
            elif p.parent.name == "rng":  # torch's generator; Python's own is not the run's (unseeded)
                out[str(p.relative_to(root))] = torch.load(p, weights_only=False)["torch"].tolist()
    return out


# Offloading the state alone is a part of offloading both (the same code moves the state); CI runs
# both, the state alone is the extended tier's (~20 s).
@pytest.mark.parametrize("weights", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["state", "state_and_weights"])
def test_training_with_offload_equals_training_without(demo_base, tmp_path, weights):
    plain = _train(copy_demo_base(demo_base, tmp_path / "plain"))
    moved = _train(copy_demo_base(demo_base, tmp_path / "offload"), "actor.offload_during_rollout=true",
                   f"actor.offload_weights={str(weights).lower()}")
    assert [r["step"] for r in moved] == [0, 1, 2] and "eval/avg@4" in moved[0]  # evaluated before step 1
    assert all(r.get("actor/offloaded_gb", 0) > 0 for r in moved[1:])  # each step's rollouts ran offloaded
    assert _comparable(moved) == _comparable(plain)
    assert _checkpoint_bytes(tmp_path / "offload") == _checkpoint_bytes(tmp_path / "plain")
