"""The CPU demo under torchrun from an empty run directory: at DP=2, at Megatron TP=2 with packed
micro-batches and at CP=2 (two HF engine replicas each time) it starts, and its first step equals a padded
one-process run's: the same evaluation, the same generated groups (rewards, lengths,
dynamic-sampling counts, all exact), and the same update (to fp32 round-off)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.records import assert_same_record, records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SHORT = ["train.total_steps=1", "eval.every=1", "logging.tensorboard=false", "checkpoint.save_every=0",
         "toy.warmup_steps=40"]


def _train(run_dir: Path, nproc: int, *overrides: str, config: str = "cpu_tiny.yaml") -> list[dict]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [
        "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / config),
        f"logging.dir={run_dir}", *SHORT, *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    return records(run_dir)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("one_process"), 1)


# TP=2 runs packed (train.pack_sequences): its records equal the padded one-process run's as well;
# CP=2 splits every row's positions over the two ranks (mcore/context_parallel.py), packed too in the
# extended tier (its CI stand-in: tests/distributed/test_policy_cp.py's packed variants)
@pytest.mark.parametrize("layout", [
    pytest.param([], id="dp2"),
    pytest.param(["parallel.tensor_model_parallel_size=2", "train.pack_sequences=true"], id="tp2_packed"),
    pytest.param(["parallel.context_parallel_size=2"], id="cp2"),
    pytest.param(["parallel.context_parallel_size=2", "train.pack_sequences=true"], id="cp2_packed",
                 marks=pytest.mark.extended)])
def test_torchrun_from_an_empty_dir_matches_one_process(one_process, tmp_path_factory, layout):
    records = _train(tmp_path_factory.mktemp("torchrun"), 2, *layout)
    assert [r["step"] for r in records] == [0, 1]
    for got, want in zip(records, one_process, strict=True):
        assert_same_record(got, want, rel=1e-4)


@pytest.mark.extended  # its CI stand-in: tests/distributed/test_moe_cp.py (the update at CP 2 and CP 2 x EP 2)
def test_the_moe_demo_at_cp2_ep2_matches_one_process(tmp_path_factory):
    """The MoE demo (conf/cpu_tiny_moe.yaml) at CP 2 x EP 2 under torchrun (the expert-parallel ranks are the
    CP ranks) against the same demo in one process (EP 1): the same first step, router loss included."""
    want = _train(tmp_path_factory.mktemp("moe_one_process"), 1, "parallel.expert_model_parallel_size=1",
                  config="cpu_tiny_moe.yaml")
    got = _train(tmp_path_factory.mktemp("moe_cp2"), 2, "parallel.context_parallel_size=2", config="cpu_tiny_moe.yaml")
    assert [r["step"] for r in got] == [0, 1] and "moe/load_balancing_loss" in got[1]
    for a, b in zip(got, want, strict=True):
        assert_same_record(a, b, round_off=("moe/",), rel=1e-4)


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    """Every rank of a node reads the same files and overrides, so every rank meets the same config
    error: the node's first rank says it, the others exit 2 quietly (each said it before: one line
    per rank)."""
    cmd = [sys.executable, "-m", "megatron_dapo.launch", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
           f"logging.dir={tmp_path}", "checkpoint.save_evry=2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    said = [line for line in (out.stdout + out.stderr).splitlines() if "megatron-dapo: config error:" in line]
    assert len(said) == 1 and "did you mean checkpoint.save_every?" in said[0], out.stderr[-3000:]
