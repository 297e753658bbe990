"""train.ppo_epochs > 1 through the real CLI: how many optimizer updates a step takes, over which
samples, and how the per-update metrics are folded into the step's record.

The trainer runs in a child process whose MegatronActor is wrapped (tests' driver below): every
call of get_loss_and_metrics is logged with a fingerprint of its mini-batch, each exchange of the
updates' metrics (reduce_metrics, once a step) with what it returned, every optimizer.step call,
and each step's old-log-prob pass (one per step, before its updates). The references are those
logs and the lr schedule's closed form, not the loop's own bookkeeping.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

PROMPTS, MINI, EPOCHS, STEPS, WARMUP, LR = 4, 2, 3, 2, 3, 1e-3
UPDATES = PROMPTS // MINI * EPOCHS  # per step

# Runs `megatron-dapo train ARGS` with the actor instrumented; one JSON event per line to $PPO_LOG.
DRIVER = r'''
import hashlib, json, os, sys
from megatron_dapo.mcore import actor as actor_mod

log = open(os.environ["PPO_LOG"], "a")
real_init = actor_mod.MegatronActor.__init__
real_update = actor_mod.MegatronActor.get_loss_and_metrics
real_old = actor_mod.MegatronActor.get_inference_log_probs
real_reduce = actor_mod.MegatronActor.reduce_metrics

def emit(**event):
    log.write(json.dumps(event) + "\n")
    log.flush()

def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    real_step = self.optimizer.step
    def step(*a, **k):
        emit(event="optimizer_step")
        return real_step(*a, **k)
    self.optimizer.step = step

def update(self, batch, forward_only=False, **kwargs):
    result = real_update(self, batch, forward_only, **kwargs)
    ids = hashlib.sha1(json.dumps([[s.prompt_ids.tolist(), s.response_ids.tolist()] for s in batch]).encode())
    emit(event="update", forward_only=forward_only, batch=ids.hexdigest(),
         metrics=result if isinstance(result, dict) else None)  # deferred: in the "metrics" event
    return result

def reduce(self, pending):
    metrics = real_reduce(self, pending)
    emit(event="metrics", updates=metrics)
    return metrics

def old(self, batch):
    emit(event="old_log_probs")
    return real_old(self, batch)

actor_mod.MegatronActor.__init__ = init
actor_mod.MegatronActor.get_loss_and_metrics = update
actor_mod.MegatronActor.get_inference_log_probs = old
actor_mod.MegatronActor.reduce_metrics = reduce
sys.argv = ["megatron-dapo", *sys.argv[1:]]
from megatron_dapo.cli import main
sys.exit(main())
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("ppo_epochs")
    (tmp / "driver.py").write_text(DRIVER)
    run_dir, events = tmp / "run", tmp / "events.jsonl"
    # Dynamic sampling off: every group is kept, so an untrained base (no warm-up) cannot starve
    # a step, and the batch is exactly PROMPTS groups.
    args = ["train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), f"logging.dir={run_dir}",
            "logging.tensorboard=false", "logging.progress=false", f"train.total_steps={STEPS}",
            f"train.ppo_epochs={EPOCHS}", f"data.prompts_per_step={PROMPTS}",
            f"train.mini_batch_prompts={MINI}",
            "rollout.n=4", "algorithm.filter_groups.enable=false", "eval.every=0", "eval.before_train=false",
            "checkpoint.save_every=0", "reward.num_workers=0", "toy.warmup_steps=0", "toy.num_train=64",
            "toy.num_val=4", f"optim.lr={LR}", f"optim.lr_warmup_steps={WARMUP}",
            "train.old_log_probs=trainer"]  # the per-step pass is what separates the steps' events
    # a run of its own, not one rank of a launcher's
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    out = subprocess.run([sys.executable, str(tmp / "driver.py"), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**env, "PPO_LOG": str(events)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return run_dir, [json.loads(line) for line in events.read_text().splitlines()]


def _step_records(run_dir: Path) -> list[dict]:
    steps = [r for r in records(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # the loops below have steps to check
    return steps


def _by_step(events: list[dict]) -> list[list[dict]]:
    """The events after each old-log-prob pass, up to the next: one list per step."""
    steps: list[list[dict]] = []
    for e in events:
        if e["event"] == "old_log_probs":
            steps.append([])
        elif steps:
            steps[-1].append(e)
    return steps


def test_each_step_takes_epochs_times_mini_batches_updates(run):
    run_dir, events = run
    for step_events, record in zip(_by_step(events), _step_records(run_dir), strict=True):
        updates = [e for e in step_events if e["event"] == "update"]
        # One optimizer step inside each update (the update is logged when it returns), no other;
        # the updates' metrics in one exchange after them.
        assert [e["event"] for e in step_events] == ["optimizer_step", "update"] * UPDATES + ["metrics"]
        assert not any(e["forward_only"] for e in updates)
        assert record["actor/num_updates"] == UPDATES
        # Each epoch is one pass over the same mini-batches in the same order.
        batches = [e["batch"] for e in updates]
        per_epoch = PROMPTS // MINI
        assert len(set(batches[:per_epoch])) == per_epoch
        assert batches == batches[:per_epoch] * EPOCHS


def test_the_record_averages_the_updates_and_maxes_the_maxima(run):
    run_dir, events = run
    for step_events, record in zip(_by_step(events), _step_records(run_dir), strict=True):
        [updates] = [e["updates"] for e in step_events if e["event"] == "metrics"]
        assert len(updates) == UPDATES and updates[0].keys() == updates[-1].keys()
        assert {k for k in record if k.startswith("actor/")} == {*updates[0], "actor/num_updates"}
        for key in updates[0]:
            values = [u[key] for u in updates]
            want = max(values) if key.endswith("_max") else sum(values) / len(values)
            assert record[key] == pytest.approx(want, rel=1e-9, abs=1e-12), (record["step"], key, values)
        # Not a constant: later epochs see a moved policy, so the averaged values are of distinct updates.
        assert len({u["actor/ppo_kl"] for u in updates}) > 1


def test_lr_warmup_counts_every_epochs_updates(run):
    """Warmup is in rollout steps, each train.ppo_epochs x mini-batches updates: update k of the
    run (from 1) uses LR * k / (WARMUP * UPDATES). The record holds each step's mean of those."""
    run_dir, _ = run
    for r in _step_records(run_dir):
        first = (r["step"] - 1) * UPDATES + 1
        want = sum(LR * k / (WARMUP * UPDATES) for k in range(first, first + UPDATES)) / UPDATES
        assert r["actor/lr"] == pytest.approx(want, rel=1e-6), r["step"]
