"""Alarms, the pass-rate ledger, format audits and dump files (megatron_dapo/observe/), in one process.

Expectations are written out by hand per case; the ledger's curation is checked against a
PromptSampler drawn without it, and its resume against the same draws made without a stop.
"""

import json
import logging

import pytest

from megatron_dapo.config import AlarmsConfig
from megatron_dapo.data.sampler import PromptSampler
from megatron_dapo.errors import InputError
from megatron_dapo.observe import audit
from megatron_dapo.observe.alarms import AlarmMonitor, read_events
from megatron_dapo.observe.ledger import PassRateLedger
from megatron_dapo.observe.rows import (SampleRow, alarm_file, clip_text, drop_from_step, dump_files, read_rows,
                                        step_file, write_rows)
from megatron_dapo.trainer_state import TrainerState


@pytest.mark.parametrize("text, flags", [
    ("Answer: 5", []),
    ("Check 12043.\nAnswer: 4", []),
    ("Answer: Answer: 5", [audit.REPEATED_LABEL]),
    ("AnswerAnswerAnswer: 3", [audit.REPEATED_LABEL]),
    ("answer: 4 (the ANSWER)", [audit.REPEATED_LABEL]),
    ("Check 65", [audit.NO_ANSWER_LINE]),
    ("Answer 5", [audit.NO_ANSWER_LINE]),  # no colon: the scorers read no answer either
    ("Answer: 3\nso the final Answer: 4", []),  # the last answer line counts, and it has one label
])
def test_format_flags(text, flags):
    assert audit.format_flags(text, rewarded=True) == flags
    # a repeated label the reward rejects is a sampled typo, not a format the policy is paid for
    assert audit.format_flags(text, rewarded=False) == [f for f in flags if f != audit.REPEATED_LABEL]


def test_only_the_tail_is_read_for_the_answer_line():
    assert audit.format_flags("Answer: 5" + "x" * audit.TAIL_CHARS, rewarded=True) == [audit.NO_ANSWER_LINE]


def test_audit_group_counts_and_flags():
    texts = ["Answer: 5", "Answer: Answer: 5", "nothing", "Answer: 5", "Answer: Answer: 7"]
    group, flags = audit.audit_group(texts, [True, True, False, True, False], [True, False, False, False, False])
    assert group == audit.GroupAudit(num_responses=5, repeated_label=1, no_answer_line=1, identical=False, disagree=2)
    assert flags == [[], [audit.REPEATED_LABEL, audit.DISAGREE], [audit.NO_ANSWER_LINE], [audit.DISAGREE], []]
    wrong, flags = audit.audit_group(["Answer: 5"] * 3, [False] * 3, None)
    assert wrong.identical and wrong.disagree == 0 and flags == [[audit.IDENTICAL_GROUP]] * 3
    solved, flags = audit.audit_group(["Answer: 5"] * 3, [True] * 3, None)  # a solved prompt: no collapse
    assert not solved.identical and flags == [[]] * 3
    assert audit.audit_metrics([group, wrong, solved]) == {
        "alarm/repeated_answer_label": 1 / 11, "alarm/no_answer_line": 1 / 11, "alarm/identical_groups": 1 / 3,
        "alarm/scorer_disagreement": 2 / 11}


def test_an_alarm_is_raised_once_and_clears(tmp_path, caplog):
    monitor = AlarmMonitor(AlarmsConfig(entropy_min=0.1), tmp_path, enabled_writes=True)
    seen = []
    with caplog.at_level(logging.WARNING, "megatron_dapo.alarms"):
        for step, entropy in enumerate([0.5, 0.05, 0.04, 0.3, 0.01], start=1):
            events, raised = monitor.check(step, {"actor/entropy": entropy})
            seen.append(([e.alarm for e in events], [r.name for r in raised]))
    assert seen == [([], []), (["entropy_collapse"], ["entropy_collapse"]), ([], ["entropy_collapse"]), ([], []),
                    (["entropy_collapse"], ["entropy_collapse"])]
    assert [e["step"] for e in read_events(tmp_path)] == [2, 5]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("alarm entropy_collapse at step 2: actor/entropy=0.05 below "
                                                   "alarms.entropy_min=0.1")


def test_a_missing_metric_leaves_an_alarm_as_it_was_and_state_restores(tmp_path):
    monitor = AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False)
    monitor.check(1, {"alarm/no_answer_line": 0.9})
    _, raised = monitor.check(2, {})  # no audit metrics this step
    assert [r.name for r in raised] == ["no_answer_line"]
    again = AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False)
    again.restore(monitor.state())
    events, _ = again.check(3, {"alarm/no_answer_line": 0.9})
    assert events == [] and not (tmp_path / "alarms.jsonl").exists()


def test_a_saturation_alarm_needs_its_steps_in_a_row_and_a_resume_keeps_the_streak(tmp_path):
    """all_correct is raised only after alarms.all_correct_steps steps in a row above its threshold:
    the healthy demo crossed it at steps 78 and 80 alone (0.917, 0.905 around 0.889), a solved data
    set stays across. The streak so far travels with the trainer state."""
    def run(monitor, values, start=1):
        return [[e.alarm for e in monitor.check(s, {"dynamic_sampling/frac_all_correct": v})[0]]
                for s, v in enumerate(values, start=start)]

    demo_tail = [0.899, 0.833, 0.899, 0.889, 0.893, 0.899, 0.917, 0.889, 0.905]  # steps 72-80 of the demo
    assert run(AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False), demo_tail) == [[]] * 9
    solved = [0.95, 0.97, 0.92, 0.99, 0.96, 0.98]
    assert run(AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False), solved) == [[]] * 4 + [["all_correct"], []]
    assert run(AlarmMonitor(AlarmsConfig(all_correct_steps=1), tmp_path, enabled_writes=False), demo_tail) == \
        [[]] * 6 + [["all_correct"], [], ["all_correct"]]
    first = AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False)
    run(first, solved[:3])
    state = TrainerState(step=3, sampler={}, alarms=tuple(first.state()), alarm_streaks=first.streaks())
    back = TrainerState.from_json(json.loads(json.dumps(state.to_json())), "trainer_state.json")
    assert back.alarm_streaks == {"all_correct": 3}
    again = AlarmMonitor(AlarmsConfig(), tmp_path, enabled_writes=False)
    again.restore(list(back.alarms), back.alarm_streaks)
    assert run(again, solved[3:], start=4) == [[], ["all_correct"], []]  # where the uninterrupted run raised it


def test_alarms_off_check_nothing(tmp_path):
    assert AlarmMonitor(AlarmsConfig(enable=False), tmp_path, enabled_writes=True).check(
        1, {"actor/entropy": 0.0}) == ([], [])


def test_ledger_records_attempts_correct_and_streaks():
    ledger = PassRateLedger()
    ledger.record([3, 5], [[True, True], [True, False]])
    ledger.record([3], [[True, True]])
    ledger.record([5], [[False, False]])
    r3, r5 = ledger.records[3], ledger.records[5]
    assert (r3.attempts, r3.correct, r3.draws, r3.solved_streak) == (4, 4, 2, 2)
    assert (r5.attempts, r5.correct, r5.draws, r5.solved_streak) == (4, 1, 2, 0)
    m = ledger.metrics()
    assert m["ledger/prompts_seen"] == 2 and m["ledger/pass_rate_1"] == 0.5 and m["ledger/pass_rate_0-0.25"] == 0.5


def test_curation_skips_retired_prompts_in_the_sampler_order():
    plain, curated = PromptSampler(6, seed=3), PromptSampler(6, seed=3)
    order = plain.next_indices(18)
    ledger = PassRateLedger(skip_solved_after=2)
    first = order[0]
    ledger.record([first, first], [[True], [True]])  # solved twice in a row: retired
    got, skipped = ledger.draw(curated, 10)
    assert got == [i for i in order if i != first][:10]
    used = [pos for pos, i in enumerate(order) if i != first][:10]
    assert skipped == order[:used[-1] + 1].count(first) == 2  # epochs 0 and 1 offered it
    assert ledger.metrics()["ledger/skipped_total"] == skipped and ledger.metrics()["ledger/retired"] == 1


def test_curation_with_every_prompt_retired_says_so():
    ledger = PassRateLedger(skip_solved_after=1)
    ledger.record([0, 1], [[True], [True]])
    with pytest.raises(InputError, match=r"every one of the 2 training prompts is retired by data.skip_solved_after=1"):
        ledger.draw(PromptSampler(2, seed=0), 1)


def test_ledger_and_sampler_resume_exactly_through_the_trainer_state():
    def batches(ledger, sampler, steps):
        out = []
        for _ in range(steps):
            got, _ = ledger.draw(sampler, 3)
            ledger.record(got, [[i % 2 == 0] * 2 for i in got])  # even prompts always solved
            out.append(got)
        return out

    ref_ledger, ref_sampler = PassRateLedger(skip_solved_after=1), PromptSampler(7, seed=1)
    want = batches(ref_ledger, ref_sampler, 6)
    ledger, sampler = PassRateLedger(skip_solved_after=1), PromptSampler(7, seed=1)
    got = batches(ledger, sampler, 3)
    state = TrainerState(step=3, sampler=sampler.state_dict(), ledger=ledger.state(), alarms=("all_correct",))
    back = TrainerState.from_json(json.loads(json.dumps(state.to_json())), "trainer_state.json")
    assert back.alarms == ("all_correct",)
    ledger, sampler = PassRateLedger(skip_solved_after=1), PromptSampler(7, seed=1)
    ledger.restore(back.ledger)
    sampler.load_state_dict(back.sampler)
    got += batches(ledger, sampler, 3)
    assert got == want and ledger.state() == ref_ledger.state()
    assert ref_ledger.skipped_total > 0  # the case exercises the curation


def test_a_trainer_state_without_ledger_or_alarms_still_reads():
    old = {"step": 2, "sampler": {}, "held_groups": [], "responses_generated": 4, "clock": {}}
    state = TrainerState.from_json(old, "x")
    assert state.ledger == {} and state.alarms == ()
    with pytest.raises(InputError, match="another version"):
        TrainerState.from_json({**old, "surprise": 1}, "x")


def test_clip_keeps_the_head_and_the_answer_line():
    text = "a" * 1000 + "\nAnswer: 42"
    clipped = clip_text(text, 200)
    assert clipped.endswith("\nAnswer: 42") and clipped.startswith("a" * 50)
    assert "[... 811 characters cut ...]" in clipped and len(clip_text("short", 200)) == 5


def _row(**kw):
    base = dict(phase="train", prompt_index=1, group=0, response_index=0, prompt="p", response="Answer: <5> & 6",
                response_tokens=3, response_chars=15, finish_reason="stop", ground_truth="5", scorer="s", acc=True,
                pred="5")
    return SampleRow(**{**base, **kw})


def test_dump_files_round_trip_and_a_resume_drops_the_later_steps(tmp_path):
    for step in (0, 1, 2, 3):
        write_rows(step_file(tmp_path, step), [_row(step=step)])
    write_rows(alarm_file(tmp_path, 3, "no_answer_line"), [_row(step=3, flags=["no_answer_line"])])
    (tmp_path / "samples" / "step_00000004.jsonl.tmp").write_text("half")
    assert read_rows(step_file(tmp_path, 2)) == [_row(step=2)]
    assert drop_from_step(tmp_path, 3) == 2
    assert [p.name for p in dump_files(tmp_path)] == ["step_00000000.jsonl", "step_00000001.jsonl",
                                                     "step_00000002.jsonl"]
    assert not list((tmp_path / "samples").glob("*.tmp"))


def test_dump_rows_and_the_ledger_histogram_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_dapo.metrics_log import MetricsLogger

    log = MetricsLogger(tmp_path, tensorboard=True, wandb=False, wandb_project="", config={}, enabled=True,
                        start_step=0)
    log.log_samples(3, "train", [_row(step=3, flags=["no_answer_line"]).to_json()])
    log.log_histogram(3, "ledger/pass_rate", [0.0, 0.5, 1.0, 1.0])
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0})
    events.Reload()
    text = events.Tensors("samples/train/text_summary")[0]
    assert text.step == 3
    table = text.tensor_proto.string_val[0].decode()
    assert "| prompt_index |" in table and "Answer: <5> & 6" in table and "no_answer_line" in table
    hist = events.Histograms("ledger/pass_rate")[0]
    assert hist.step == 3 and hist.histogram_value.num == 4 and hist.histogram_value.max == 1.0


def test_dump_rows_reach_wandb_as_a_table(tmp_path, monkeypatch):
    """logging.wandb=true, offline (no network here): the real wandb writes the table it would upload."""
    pytest.importorskip("wandb", reason="wandb is in the test extra: ./install.sh test")
    from megatron_dapo.metrics_log import MetricsLogger

    import wandb

    wandb.teardown()  # wandb keeps its first settings per process: an earlier run's must not decide this one
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, tensorboard=False, wandb=True, wandb_project="test", config={"seed": 1},
                        enabled=True, start_step=0)
    log.log_samples(3, "train", [_row(step=3, flags=["no_answer_line"]).to_json()])
    log.log(3, {"reward/acc_mean": 0.5})
    log.close()
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/samples/train_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"][:2] == ["prompt_index", "response_index"]
    assert table["data"] == [["1", "0", "True", "None", "5", "5", "None", "None", "['no_answer_line']",
                              "Answer: <5> & 6"]]
    assert (tmp_path / "wandb_id.txt").read_text().strip()


def test_a_resumed_observer_drops_the_later_steps_dumps_and_alarm_events(tmp_path):
    from megatron_dapo.config import DAPOConfig
    from megatron_dapo.observe.observer import Observer

    for step in range(5):
        write_rows(step_file(tmp_path, step), [_row(step=step)])
    (tmp_path / "alarms.jsonl").write_text("".join(json.dumps({"step": s, "alarm": "x"}) + "\n" for s in (1, 3)))
    state = TrainerState(step=2, sampler={}, ledger={"skipped_total": 3, "records": {"7": [8, 8, 1, 1]}},
                         alarms=("no_answer_line",))
    obs = Observer(DAPOConfig(), tmp_path, rank=0, start=2, num_replicas=1, resume=state)
    assert [p.name for p in dump_files(tmp_path)] == [f"step_{s:08d}.jsonl" for s in range(3)]
    assert [e["step"] for e in read_events(tmp_path)] == [1]
    assert obs.ledger.state() == state.ledger and obs.alarms.state() == ["no_answer_line"]
    Observer(DAPOConfig(), tmp_path, rank=1, start=0, num_replicas=1)  # not rank 0: touches nothing
    assert len(dump_files(tmp_path)) == 3
    Observer(DAPOConfig(), tmp_path, rank=0, start=0, num_replicas=1)  # a fresh run: nothing kept
    assert dump_files(tmp_path) == [] and read_events(tmp_path) == []
