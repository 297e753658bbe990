"""observe/step_progress.py and rollout/gen_progress.py: lines only when due (a log's interval, a
terminal's rewrite), what they say, and the engines' counts against the responses they return."""

import io

import pytest

from megatron_dapo.observe.step_progress import StepProgress, fmt_seconds, generation_detail
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.gen_progress import GenerationCounter, GenerationProgress
from megatron_dapo.rollout.hf_engine import HFEngine
from tests.helpers.rollout import tiny_qwen2


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(tty: bool = False, every_s: float = 30.0):
    out, clock = io.StringIO(), Clock()
    return StepProgress(10, every_s, stream=out, tty=tty, clock=clock), out, clock


def test_a_log_gets_a_line_per_interval_and_a_short_step_none():
    progress, out, clock = _progress()
    progress.begin_step(4)
    progress.phase("updating")
    progress.count(1, 16, "update")  # 0 s into the step: not due
    clock.now += 29.0
    progress.count(2, 16, "update")
    assert out.getvalue() == ""
    clock.now += 1.0
    progress.count(3, 16, "update")
    assert out.getvalue() == "  step 4/10 updating | update 3/16 | about 2m10s left | 30s so far\n"
    clock.now += 10.0
    progress.count(4, 16, "update")  # the next line is 30 s after the last one
    assert out.getvalue().count("\n") == 1
    progress.end_step()
    clock.now += 100.0
    assert not progress.due()  # between steps nothing is due
    progress.begin_step(5)
    clock.now += 5.0
    progress.note("x")
    assert out.getvalue().count("\n") == 1


def test_a_part_that_reports_nothing_while_it_runs_says_so_when_it_was_long():
    progress, out, clock = _progress()
    progress.begin_step(2)
    progress.phase("writing the checkpoint", last_s=12.0)  # shorter than the interval: nothing
    progress.phase("writing the checkpoint", last_s=95.0)
    assert out.getvalue() == "  step 2/10 writing the checkpoint | the last took 1m35s | 0.0s so far\n"


def test_a_terminal_line_is_rewritten_in_place_and_cleared_before_the_step_line():
    progress, out, clock = _progress(tty=True)
    assert progress.every_s == 0.5
    progress.begin_step(1)
    progress.phase("generating", "batch 1")
    clock.now += 0.6
    progress.note("a")
    clock.now += 0.6
    progress.note("b")
    progress.end_step()
    assert out.getvalue().split("\r\x1b[2K") == ["", "  step 1/10 generating (batch 1) | a | 0.6s so far",
                                                 "  step 1/10 generating (batch 1) | b | 1.2s so far", ""]
    assert "\n" not in out.getvalue()


def test_disabled_progress_is_never_due():
    out = io.StringIO()
    progress = StepProgress(10, 0.0, enabled=False, stream=out, tty=False)
    progress.begin_step(1)
    progress.phase("generating", last_s=1e9)
    progress.count(1, 2, "update")
    assert not progress.due() and out.getvalue() == ""


def test_generation_detail_and_its_bound():
    p = GenerationProgress(finished=812, total=2048, tokens=3_211_000, longest=8190, max_tokens=20480, seconds=1000.0)
    assert generation_detail(p) == ("responses 812/2048 | 3,211 tok/s | longest 8,190/20,480 | "
                                    "at most 25m00s left")  # 12,290 steps to the limit at 8.19 steps/s
    assert GenerationProgress(5, 5, 10, 2, 16, 1.0).seconds_left_at_most() is None
    assert [fmt_seconds(s) for s in (0.42, 59, 61, 3599, 3661)] == ["0.4s", "59s", "1m01s", "59m59s", "1h01m"]


class Sink:
    def __init__(self):
        self.reports: list[GenerationProgress] = []

    def due(self) -> bool:
        return True

    def generation(self, progress: GenerationProgress) -> None:
        self.reports.append(progress)


@pytest.mark.parametrize("max_batch_size", [256, 5])  # one part, or chunks counted together
def test_the_hf_engine_counts_what_it_returns(max_batch_size):
    engine = HFEngine(tiny_qwen2(0), eos_token_ids=[3], max_batch_size=max_batch_size)
    sink = Sink()
    engine.on_progress = sink
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    out = [r for group in engine.generate([[5, 6, 7], [8, 9]], 6, params) for r in group]
    lengths = [len(r.response_ids) for r in out]
    reports = sink.reports
    assert reports and all(r.total == 12 and r.max_tokens == 24 for r in reports)
    assert [r.tokens for r in reports] == sorted(r.tokens for r in reports)  # never back
    assert [r.finished for r in reports] == sorted(r.finished for r in reports)
    assert reports[-1].tokens < sum(lengths) and reports[-1].longest <= max(lengths)
    stopped = sum(r.finish_reason == "stop" for r in out)
    assert 0 < stopped < 12  # the seed gives both kinds
    if max_batch_size == 256:  # one part: only those that stopped end before the last token
        assert reports[-1].finished <= stopped
    else:  # a part counts its responses when it ends, at their limit or not
        assert any(r.finished > stopped for r in reports)
    engine.on_progress = None
    assert engine.generate([[5, 6, 7], [8, 9]], 6, params)[0][0].response_ids == out[0].response_ids


def test_a_counter_without_a_sink_is_never_due():
    counter = GenerationCounter(None, 4, 16)
    assert not counter.due()
    counter.part_done([3, 5])
    sink = Sink()
    counter.sink = sink
    counter.report(1, 4, 2)
    assert (sink.reports[0].finished, sink.reports[0].tokens, sink.reports[0].longest) == (3, 12, 5)
