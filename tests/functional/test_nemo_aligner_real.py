"""The DAPO adapter inside the real NeMo-Aligner 0.7.0 stack (NeMo 2.1.0, megatron-core 0.10.0) on CPU
over gloo: each test runs a probe of tests/nemo_aligner/ in .venv-nemo (./install.sh nemo) and checks
what it reports against a reference written independently of the adapter.

- one training step at 1 rank x 4 micro-batches and 2 ranks x 2: loss, metrics, gradients and the
  AdamW update equal a hand-written whole-batch token-mean; upstream PPO's own loss on the same rows
  is a mean of per-micro-batch means, and differs;
- DAPOTrainer.fit() for 2 steps at 1 and 2 ranks: which prompts each generation batch drew, which
  groups trained on which rank, the sampler's counts, consumed_samples, all as worked out by hand
  from the prompt/reward rule below;
- a checkpoint through NeMo's callback, a new process resuming from it, one more step: equal to an
  uninterrupted run, bitwise;
- the CPU stand-ins: their pins are checked, and each one's removal stops the run where it says.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import nemo_venv

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _needs_nemo():
    nemo_venv.require_nemo()


@pytest.mark.parametrize("nproc", [1, 2], ids=["1rank_x4mb", "2ranks_x2mb"])
def test_one_step_equals_whole_batch_token_mean(tmp_path, nproc):
    r = nemo_venv.torchrun("probe_step.py", nproc, tmp_path / "out.json", "2")
    assert (r["dp"], r["micro_batches"]) == (nproc, 4 // nproc)
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
    assert r["metrics"] == pytest.approx(r["ref_metrics"], rel=1e-6)
    assert r["ref_metrics"]["actor/pg_clipfrac_high"] > 0 and r["ref_metrics"]["actor/pg_clipfrac_low"] > 0
    assert r["grad_max_rel"] < 1e-5, r["grad_max_rel"]  # measured 4.0e-7 (1 rank), 4.7e-7 (2 ranks)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-6)
    # Adam's first step is lr * g / (|g| + eps): elements with |g| near eps amplify the 4e-7 of the
    # gradients (4.4e-4 on one machine, 2.3e-3 on another): compared where |g| > 100 eps (probe_step.py;
    # measured there 7.5e-6 at 1 and 2 ranks)
    assert r["update_max_rel"] < 1e-3, r["update_max_rel"]
    assert r["all_changed"] and r["optimizer"] == "AdamW"
    if nproc == 1:  # upstream's PPO loss_func on the same rows: per-micro-batch means, averaged
        assert r["upstream_loss"] == pytest.approx(r["upstream_hand_loss"], rel=1e-6)
        assert abs(r["upstream_loss"] / r["token_mean_symmetric_loss"] - 1) > 0.05


def _expected_steps(steps: int, per_step: int = 3, gen_batch: int = 4) -> list[dict]:
    """loop.py's rule, worked by hand: prompt i is all correct when i % 3 == 0, all wrong when
    i % 3 == 1, mixed when i % 3 == 2; generation batches of 4 consecutive prompts until 3 mixed."""
    out, nxt = [], 0
    for _ in range(steps):
        drawn, mixed = [], []
        while len(mixed) < per_step:
            batch = list(range(nxt, nxt + gen_batch))
            nxt += gen_batch
            drawn.append(batch)
            mixed += [i for i in batch if i % 3 == 2]
        ids = [i for b in drawn for i in b]
        sampling = {"num_gen_batches": len(drawn), "num_groups_generated": len(ids),
                    "num_groups_kept": len(mixed), "num_dropped_all_correct": sum(i % 3 == 0 for i in ids),
                    "num_dropped_all_wrong": sum(i % 3 == 1 for i in ids), "num_groups_carried_in": 0,
                    "num_surplus_dropped": len(mixed) - per_step,
                    "num_filled": 0}  # algorithm.filter_groups.on_exhausted=fill, never exhausted here
        out.append({"drawn": drawn, "trained": mixed[:per_step], "consumed_samples": nxt,
                    "sampling": sampling})
    return out


# one rank (~25 s) is the extended tier's: the 2-rank fit counts the same rows over DP
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.extended), 2], ids=["1rank", "2ranks"])
def test_fit_dynamic_sampling_counts(tmp_path, nproc):
    r = nemo_venv.torchrun("probe_fit.py", nproc, tmp_path / "out.json")
    assert (r["dp"], r["trainer_step"], r["optimizer_steps"]) == (nproc, 2, 4)  # 12 rows / 6 per update
    assert r["weights_moved"]
    group = 4  # tests/nemo_aligner/shape.GROUP
    # the reward server's round counter (loop.RewardServer): steps x batches x micro-batches x G
    assert r["reward_calls_rank0"] == 2 * 3 * (4 // nproc // 2) * group
    for got, want in zip(r["steps"], _expected_steps(2), strict=True):
        assert got["drawn"] == want["drawn"]
        rows = [i for i in want["trained"] for _ in range(group)]
        share = len(rows) // nproc
        assert got["trained_per_rank"] == [rows[k * share:(k + 1) * share] for k in range(nproc)]
        assert got["consumed_samples"] == want["consumed_samples"]  # prompts, not responses
        assert got["sampling"] == want["sampling"]
        assert got["advantage_rows"] == len(rows) // nproc  # every kept row carries an advantage
        # every round's durations come back (NeMo's timer holds one per name: consumed per round)
        assert {"generate", "logprobs", "critic_wait", "prepare_for_inference",
                "finish_inference"} <= set(got["timers"])


@pytest.mark.extended  # three probes; CI keeps the step and fit probes above
@pytest.mark.timeout(900)  # three probes of up to 300 s each (each takes ~35 s here)
def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    runs = {}
    for mode, logs in (("first", "logs"), ("resume", "logs"), ("straight", "logs_straight")):
        runs[mode] = nemo_venv.torchrun("probe_ckpt.py", 1, tmp_path / f"{mode}.json", mode,
                                        str(tmp_path / logs))
    first, resume, straight = runs["first"], runs["resume"], runs["straight"]
    assert any(f.endswith("common.pt") for f in first["files"])
    assert any(f.endswith(".distcp") for f in first["files"])
    assert resume["resumed_from"]["ckpt_path"] and "-last" in resume["resumed_from"]["ckpt_path"]
    assert {k: resume["resumed_from"][k] for k in ("step", "consumed_samples", "optimizer_steps")} == {
        "step": 1, "consumed_samples": first["consumed_samples"], "optimizer_steps": first["optimizer_steps"]}
    assert straight["trained"] == first["trained"] + resume["trained"]
    for key in ("step", "consumed_samples", "optimizer_steps"):
        assert resume[key] == straight[key], key
    assert resume["weights"] == straight["weights"]  # bitwise: floats through JSON
    assert resume["adam"] == straight["adam"]
    assert first["weights"] != straight["weights"]


@pytest.mark.extended  # a check of the pinned NeMo stack: each stand-in removed in turn
def test_every_cpu_standin_is_needed(tmp_path):
    out = tmp_path / "out.json"
    r = nemo_venv.run([str(nemo_venv.NEMO_PYTHON), str(nemo_venv.PROBES / "probe_removal.py"), str(out)], out,
                      timeout=500)  # under pytest-timeout's 600 s, so the session is killed here
    assert not r.pop("baseline")["failed"]
    listed = json.loads(subprocess.run(
        [str(nemo_venv.NEMO_PYTHON), "-c", "import sys, json; sys.path.insert(0, '.'); "
         "from tests.nemo_aligner import standins; print(json.dumps([s.name for s in standins.STANDINS]))"],
        cwd=nemo_venv.REPO, env=nemo_venv.env(), capture_output=True, text=True, check=True).stdout)
    assert sorted(r) == sorted(listed)
    not_needed = {k: v["error_tail"][-300:] for k, v in r.items() if not (v["failed"] and v["stop_seen"])}
    assert not not_needed, f"stand-ins whose removal did not stop the run where they say: {not_needed}"


CHECK_PINS = """
import sys; sys.path.insert(0, '.')
from pathlib import Path
from tests.nemo_aligner import standins
standins.check_pins()
copy = Path(sys.argv[1])
s = standins.BY_NAME['cuda_literals']
path, line = s.where.rsplit(':', 1)
src = (standins._site() / path).read_text().splitlines()
src[int(line) - 1] = '    total_num_tokens = 0  # changed upstream'
(copy / path).parent.mkdir(parents=True)
(copy / path).write_text('\\n'.join(src))
for t in standins.STANDINS:
    if t.name != s.name:
        p = copy / t.where.rsplit(':', 1)[0]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text((standins._site() / t.where.rsplit(':', 1)[0]).read_text())
standins._site = lambda: copy
standins.PINS['nemo-aligner'] = '0.7.1'
try:
    standins.check_pins()
except RuntimeError as e:
    print(e)
"""


def test_pins_fail_loudly_when_upstream_moves(tmp_path):
    proc = subprocess.run([str(nemo_venv.NEMO_PYTHON), "-c", CHECK_PINS, str(tmp_path)], cwd=nemo_venv.REPO,
                          env=nemo_venv.env(), capture_output=True, text=True, check=True)
    assert "nemo-aligner is 0.7.0, the stand-ins are written against 0.7.1" in proc.stdout
    assert "stand-in cuda_literals: megatron/core/pipeline_parallel/schedules.py:449 reads" in proc.stdout
    assert proc.stdout.count("stand-in ") == 1  # every other stand-in's line is as pinned
