"""Partial rollouts (rollout.partial, rollout/partial.py) through the real CLI under torchrun: 4
processes, ranks 0-1 training at DP=2, ranks 2-3 two HF engine replicas; responses grow by at most
4 tokens a generation batch (the toy's answers take ~5-13 of its 16).

- With staleness 1 the demo learns: held-out avg@4 from the untrained base's ~0.1 to well above it.
- Every dumped response's pieces carry the versions of the timeline written out by hand: a group's
  responses start in one batch, piece j comes from the j-th batch after it, and a batch's version
  is its step's (or the step before's when asked for ahead); every piece but the last is 4 tokens.
- At staleness 1 a kill after a save with groups carried, then a stop (SIGTERM to every rank) with
  a batch in flight that continues carried groups, resume to the uninterrupted run's records.
"""

import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers.demo import copy_demo_base
from tests.helpers.separate_runs import kill_all, records, reference_run, run, start_then, stop_every_rank, values

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
PIECE = 4
PARTIAL = ["rollout.partial=true", f"rollout.partial_tokens={PIECE}"]


def _batch_versions(recs: list[dict], steps: int, save_every: int) -> tuple[list[int], dict[int, int]]:
    """(the weight version of every generation batch in the order drawn, the position of each
    step's first batch): staleness 1, so a step's first batch was asked for one step earlier
    (version step - 1) unless a start or a save came just before it; further batches are the step's.
    The groups of a step's first batch are dumped, so a dumped step had one."""
    versions, first = [], {}
    for step in range(steps):
        first[step] = len(versions)
        batches = int(recs[step + 1]["dynamic_sampling/num_gen_batches"])  # 0: groups carried over filled it
        versions += [step - 1 if step % save_every else step][:batches] + [step] * (batches - 1)
    return versions, first


def test_partial_rollouts_learn_and_their_pieces_follow_the_timeline(demo_base, tmp_path):
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    run(run_dir, *PARTIAL, "rollout.max_staleness=1", "train.total_steps=40", "eval.every=0",
        "checkpoint.save_every=10")
    recs = records(run_dir)
    start, end = recs[0]["eval/avg@4"], recs[-1]["eval/avg@4"]
    assert end > start + 0.3, (start, end)
    trained = recs[1:]
    # answers take 5-13 tokens at first (most are cut), and the policy learns shorter ones
    assert max(r["rollout/partial_responses"] for r in trained) > 0.9
    assert sum(r["rollout/partial_responses"] for r in trained) / len(trained) > 0.3
    assert max(r["rollout/carried_groups"] for r in trained) > 0
    assert max(r["rollout/version_lag_max"] for r in trained) >= 2  # first pieces older than staleness 1
    versions, first = _batch_versions(recs, 40, 10)
    groups = defaultdict(list)  # the dumped groups (whole groups of the step's first batch)
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            if row["phase"] == "train":
                groups[row["step"], row["group"]].append(row)
    assert len(groups) > 100
    for (record, _), rows in groups.items():
        pieces = [row["pieces"] or [[row["weight_version"], row["response_tokens"]]] for row in rows]
        began = first[record - 1] - max(map(len, pieces)) + 1  # its longest response ends in this batch
        for got, row in zip(pieces, rows):
            assert [v for v, _ in got] == versions[began:began + len(got)], (record, row["prompt_index"], got)
            assert all(n == PIECE for _, n in got[:-1]) and sum(n for _, n in got) == row["response_tokens"]


# A 60-s grace (the default is 25): on a loaded machine the stop's wait for the batch in flight must
# not run into the save's margin and release it (its rollouts are what the stop test checks).
STALE1 = [*PARTIAL, "rollout.max_staleness=1", "train.total_steps=8", "checkpoint.save_every=4", "eval.every=0",
          "eval.before_train=false", "checkpoint.stop_grace_s=60"]


@pytest.fixture(scope="module")
def reference(demo_base, tmp_path_factory) -> Path:
    return reference_run(demo_base, tmp_path_factory, "partial_reference", *STALE1)


# In CI: a stop then a kill of the separate placement resuming to the uninterrupted run's records
# (test_async_rollouts.py), the stop's held groups in the checkpoint (test_resume_carry.py) and the
# carried pieces' state written out by hand (tests/unit/test_partial_rollouts.py). This one (~80 s
# with its reference run) puts them together with partial rollouts.
@pytest.mark.extended
def test_a_kill_then_a_stop_resume_partial_rollouts_to_the_same_records(reference, tmp_path):
    """A kill of every process after step 6 resumes from step 4's checkpoint, which holds groups
    still growing; SIGTERM to every rank after step 5 then stops the run after step 6 (or 7) with
    the next step's batch in flight, continuing carried groups, kept in the checkpoint; the last
    launch finishes.
    One run dir, three launches, the uninterrupted run's records."""
    carried = {r["step"]: r["rollout/carried_groups"] for r in records(reference) if r["step"]}
    assert carried[4] and carried[6] and carried[7], f"no group carried at steps 4, 6, 7 of the reference: {carried}"
    run_dir = copy_demo_base(reference, tmp_path / "run")
    start_then(run_dir, STALE1, 6, kill_all)
    assert records(run_dir)[-1]["step"] < 8, "the run finished before the kill"
    saved = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert saved["carried"] and not saved["ahead"]  # drained at the save, groups still growing
    status, log = start_then(run_dir, STALE1, 5, stop_every_rank)
    assert status == 0, log[-5000:]
    # the signal lands in step 6 (a loaded machine: in step 7); the next step's batch is in flight
    stopped = records(run_dir)[-1]["step"]
    assert stopped in (6, 7), f"stopped after step {stopped}, not in step 6 or 7"
    state = json.loads((run_dir / "checkpoints" / f"step_{stopped:08d}" / "trainer_state.json").read_text())
    assert [a["step"] for a in state["ahead"]] == [stopped] and state["ahead"][0]["rollouts"]
    assert state["ahead"][0]["carried"]  # the batch in flight continues carried groups
    run(run_dir, *STALE1)
    assert values(records(run_dir)) == values(records(reference))
