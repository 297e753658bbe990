"""Bounded staleness (rollout.max_staleness, rollout/pipeline.py) through the real CLI under torchrun:
4 processes, ranks 0-1 training at DP=2 and ranks 2-3 holding two HF engine replicas that generate
the next steps' first batches while the trainers train.

- At staleness 1 the demo learns: held-out avg@4 from the untrained base's ~0.1 to well above it.
- The lag each record reports is the timeline the pipeline's rule gives, written out by hand (the
  engines stamp every rollout with the weight version they held; the trainer subtracts).
- Groups carried over (surplus=carry) that fill a step leave no batch in flight at a save.
- At staleness 2 a stop (SIGTERM to every rank, trainers and engines) with a batch in flight keeps
  it in the checkpoint, and a later kill of every process resumes from a drained checkpoint: the
  run dir ends with the uninterrupted run's records, value for value.
- A stop whose batch in flight the engines cannot finish before the kill saves it as a request,
  asked for again at resume.
- A generation budget spent with batches asked for ahead cancels them: the engines drop their
  results and serve the final evaluation.
- A batch that outlasts every process group's timeout ends no run (no collective waits for the
  engines' work), and one thread drives each engine rank's weight transfers.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.demo import copy_demo_base
from tests.helpers.separate_runs import (
    ENV, ROOT, cancel_at_budget_end, command, cut_in_generation, kill_all, records, reference_run, run,
    stall_then_stop, start_then, stop_every_rank, values,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STALLING = "tests.helpers.stalling_engine"


def test_staleness_1_learns_and_reports_the_lag_of_its_timeline(demo_base, tmp_path):
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    log = run(run_dir, "rollout.max_staleness=1", "train.total_steps=40", "eval.every=0", "checkpoint.save_every=10")
    recs = records(run_dir)
    start, end = recs[0]["eval/avg@4"], recs[-1]["eval/avg@4"]
    assert end > start + 0.3, (start, end)
    # Records 1, 11, 21, 31 follow a start or a save: nothing was in flight, the step drew its own
    # first batch (lag 0). Every other step trained on a batch asked for one step earlier.
    lag_max = {r["step"]: r["rollout/version_lag_max"] for r in recs if r["step"]}
    assert lag_max == {s: 0.0 if s % 10 == 1 else 1.0 for s in range(1, 41)}
    assert all(0 < r["rollout/version_lag_mean"] <= 1 for r in recs if r["step"] % 10 not in (0, 1))
    assert all(r["rollout_corr/is_frac_high"] >= 0 for r in recs if r["step"])  # token TIS on by default
    assert "derived algorithm.rollout_correction.rollout_is: null -> token (rollout.max_staleness=1:" in log
    assert "derived algorithm.rollout_correction.rollout_is_threshold: 2.0 -> 2.0" not in log  # only what changed
    assert "rollout_is: token" in (run_dir / "config.yaml").read_text()
    assert all(r["timing_s/trainer_waited"] >= 0 and r["timing_s/engines_idle"] >= 0 for r in recs if r["step"])


STALE2 = ["rollout.max_staleness=2", "train.total_steps=6", "checkpoint.save_every=3", "eval.every=0",
          "eval.before_train=false"]


@pytest.fixture(scope="module")
def reference(demo_base, tmp_path_factory) -> Path:
    return reference_run(demo_base, tmp_path_factory, "async_reference", *STALE2)


def test_staleness_2_lags_as_its_timeline(reference):
    # Steps 2 and 3 were asked for in step 1, steps 5 and 6 in step 4 (the save at 3 drains).
    assert [r["rollout/version_lag_max"] for r in records(reference)] == [0, 1, 2, 0, 1, 2]


def test_a_stop_then_a_kill_resume_to_the_same_records(reference, tmp_path):
    """SIGTERM to every rank after step 1 stops the run after step 2 with step 3's batch in flight,
    kept in the checkpoint; the rerun takes it, saves at step 3 and is killed (every process) after
    step 5; the last rerun resumes from step 3's drained checkpoint. One run dir, three launches."""
    run_dir = copy_demo_base(reference, tmp_path / "run")

    status, log = start_then(run_dir, STALE2, 1, stop_every_rank)
    assert status == 0, log[-5000:]  # every process, the engines' too
    stopped = records(run_dir)[-1]["step"]
    assert f"stopped by SIGTERM after step {stopped} of 6" in log
    assert stopped == 2, f"stopped after step {stopped}: the stop was meant for step 2, with step 3's batch in flight"
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert [a["step"] for a in state["ahead"]] == [2] and state["ahead"][0]["rollouts"]
    start_then(run_dir, STALE2, 5, kill_all)
    assert records(run_dir)[-1]["step"] < 6, "the run finished before the kill"
    run(run_dir, *STALE2)
    assert values(records(run_dir)) == values(records(reference))


def test_carried_over_groups_that_fill_a_step_leave_nothing_in_flight(demo_base, tmp_path):
    """surplus=carry with a generation batch of 6 steps' prompts: most steps start full of groups
    carried over. The batch asked for ahead of such a step is taken all the same (and nothing new is
    asked for when they fill the next step), so the save at step 3 finds nothing in flight. Before,
    the untaken batch stayed at the pipeline's head and the save failed ("still in flight")."""
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    run(run_dir, "rollout.max_staleness=1", "algorithm.filter_groups.surplus=carry", "data.prompts_per_step=4",
        "data.gen_prompts_per_batch=24", "train.total_steps=4", "checkpoint.save_every=3", "eval.every=0",
        "eval.before_train=false")
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert any(r["dynamic_sampling/num_gen_batches"] == 0 for r in recs[:3])  # steps full before they began
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()


def test_a_batch_that_outlasts_every_collective_timeout_ends_no_run(reference, tmp_path):
    """Every process group's collectives may wait 6 s (parallel.timeout_minutes=0.1) while step 3's
    batch, asked for in step 1, stalls 15 s on both engines (tests/helpers/stalling_engine.py,
    STALL_S): trainer rank 0 polls the engines' progress in the store while the other trainer rank and
    the engines' main threads wait for its next message in the store, so no collective waits for the
    batch, and the run writes the reference's records (default timeout) value for value. Traced
    (tests/helpers/traced_collectives.py): on each engine rank one thread, the worker, issued every
    operation of the weight transfer group, trainer rank 0's main thread every one of its own, and
    each member shut the group down at the end; rollouts went from each replica's leader to trainer
    rank 0 alone; the engine ranks dropped the launcher's CUDA_DEVICE_MAX_CONNECTIONS. (With the
    engines' requests and results on the transfer group, as before, trainer rank 0's wait for the
    batch was a gloo collective that timed out.)"""
    run_dir = copy_demo_base(reference, tmp_path / "run")
    trace = tmp_path / "trace"
    trace.mkdir()
    log = run(run_dir, *STALE2, "parallel.timeout_minutes=0.1", "rollout.engine=stalling_hf",
              module="tests.helpers.traced_collectives",
              env={"STALL_CALL": "3", "STALL_S": "15", "TRACE_DIR": str(trace),
                   "CUDA_DEVICE_MAX_CONNECTIONS": "1"})  # as recipes/lib/launch.sh sets it for every rank
    assert log.count("call 3 stall ended after 15 s") == 2, log[-3000:]
    assert values(records(run_dir)) == values(records(reference))
    ranks = {r: json.loads((trace / f"rank{r}.json").read_text()) for r in range(4)}
    assert ranks[0]["threads"]["transfer"] == ["MainThread"] and "transfer" not in ranks[1]["threads"], ranks
    for r in (2, 3):
        assert ranks[r]["threads"] == {"transfer": ["engine-worker"]} and ranks[r]["calls"]["transfer"] > 6, ranks[r]
    assert [ranks[r]["transfer_ended"] for r in (0, 2, 3)] == ["shutdown"] * 3, ranks
    # results only where they are needed: each replica's leader sends its rollouts to trainer rank 0
    sent = [ranks[r]["calls"].get("send_object", 0) for r in range(4)]
    assert sent[:2] == [0, 0] and sent[2] == sent[3] > 0 and ranks[0]["calls"]["recv_object"] == sum(sent)
    assert "recv_object" not in ranks[1]["calls"] | ranks[2]["calls"] | ranks[3]["calls"]
    # the launcher's CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's) stays on the trainers only
    assert [ranks[r]["CUDA_DEVICE_MAX_CONNECTIONS"] for r in range(4)] == ["1", "1", None, None], ranks


def test_an_engine_failure_ends_every_rank_naming_it_and_aborts_the_links(demo_base, tmp_path):
    """Both engine ranks fail their first weight load (rollout.engine=failing_hf,
    tests/helpers/traced_collectives.py): trainer rank 0 learns it from the progress counters and
    raises it, naming an engine rank and its error, and every rank ends (none waits for a peer
    that has left); every member aborts the transfer group instead of shutting it down."""
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    trace = tmp_path / "trace"
    trace.mkdir()
    out = subprocess.run(command(run_dir, "rollout.engine=failing_hf", "train.total_steps=2",
                                 module="tests.helpers.traced_collectives"),
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**ENV, "TRACE_DIR": str(trace)})
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    # both engine ranks fail; the progress counters name whichever trainer rank 0 reads first
    assert re.search(r"RuntimeError: engine rank [01] failed: ValueError: failing_hf refuses every weight load",
                     log), log[-3000:]
    ended = {r: json.loads((trace / f"rank{r}.json").read_text())["transfer_ended"] for r in (0, 2, 3)}
    assert ended == {0: "abort", 2: "abort", 3: "abort"}, ended


STALL = ["rollout.engine=stalling_hf", "rollout.max_staleness=1", "algorithm.filter_groups.enable=false",
         "train.total_steps=8", "checkpoint.save_every=3", "checkpoint.stop_grace_s=15", "eval.every=0",
         "eval.before_train=false"]


def test_a_stop_releases_a_batch_the_engines_cannot_finish_before_the_kill(demo_base, tmp_path):
    """Step 6's batch, asked for in step 5, stalls on the engines (tests/helpers/stalling_engine.py)
    while SIGTERM, sent in step 5, stops the run after it with a 15-s grace: the stop polls the
    engines until waiting longer would leave the save too little time, then saves the batch as a
    request (prompts, seed), and the trainers exit 0 before the kill; the engines abort the batch
    (its stall ended by the abort on both) and exit too. The resumed run asks for it again: step 6
    trains on it from the checkpoint's weights (lag 0 where the uninterrupted run's is 1), and the
    run ends with every step's record once."""
    run_dir = copy_demo_base(demo_base, tmp_path / "run")
    status, log = stall_then_stop(run_dir, STALL)
    assert status == 0, log[-5000:]
    assert "stopped by SIGTERM after step 5 of 8" in log, log[-3000:]
    assert "1 generation batch(es) in flight not finished in time" in log and "abandoning" not in log
    assert log.count("call 6 stall ended by an abort") == 2 and "released at the stop, aborted" in log, log[-3000:]
    state = json.loads((run_dir / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert [(a["step"], a["rollouts"]) for a in state["ahead"]] == [(5, None)]
    assert records(run_dir)[-1]["rollout/version_lag_max"] == 1  # step 5's batch came from step 4's weights
    run(run_dir, *STALL, module=STALLING)
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert recs[5]["rollout/version_lag_max"] == 0  # asked for again at resume, from step 5's weights


CUT = ["algorithm.filter_groups.enable=false", "train.total_steps=6", "checkpoint.save_every=2",
       "checkpoint.stop_grace_s=10", "eval.every=0", "eval.before_train=false"]


# In CI: the cut and its exact resume with the HF engine colocated at 1 and 2 processes (test_faults.py),
# a stop on the separate engines releasing their batch (above) and vLLM's abort of the batch its
# engine ranks generate (test_async_rollouts_vllm.py). This one (~75 s) puts them together.
@pytest.mark.extended
def test_a_stop_while_the_engines_generate_cuts_the_step_and_resumes_exactly(demo_base, tmp_path_factory):
    """SIGTERM to every rank while both engine ranks stall in step 4's batch (separate placement,
    DP=2 trainers): trainer rank 0's wait for the batch is cut short, the engines abort it and serve
    on until the trainers stop them, step 3 is saved as it was at step 4's start (the last save was
    step 2's), every process exits 0 within the 10-s grace, and the resumed run ends with the
    uninterrupted run's records, value for value. Before, the stop waited for the batch and
    abandoned the step at the grace's end: the resume went back to step 2. (With batches asked for
    ahead the step's start collects them, finished before its sync: the staleness tests above run
    through it, their records equal to uninterrupted runs.)"""
    reference = reference_run(demo_base, tmp_path_factory, "cut_reference", *CUT)
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("cut") / "run")
    status, log = cut_in_generation(run_dir, ["rollout.engine=stalling_hf", *CUT], stall=4, after_step=3,
                                    saves=3)
    assert status == 0, log[-5000:]
    assert "megatron-dapo: SIGTERM: step 4 cut short in its generation; saving steps 3-3" in log, log[-3000:]
    assert "stopped by SIGTERM after step 3 of 6, step 4 cut short in its generation" in log, log[-3000:]
    assert log.count("call 4 stall ended by an abort") == 2 and "cut short at a stop, aborted" in log, log[-3000:]
    assert "abandoning" not in log and "Traceback" not in log, log[-3000:]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    run(run_dir, *CUT)
    assert values(records(run_dir)) == values(records(reference))


def test_a_spent_generation_budget_cancels_the_batches_asked_for_ahead(demo_base, tmp_path):
    """The batches of steps 3 and 4 are generated, not collected, when the budget is spent in step 2
    (separate_runs.cancel_at_budget_end): the trainers cancel both, each engine rank drops their
    results, loads step 2's weights and runs the final evaluation. (A batch still generating when
    nobody will collect it is aborted: the stop tests above, released at the stop.)"""
    cancel_at_budget_end(copy_demo_base(demo_base, tmp_path / "run"), "hf")
