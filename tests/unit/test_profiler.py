"""StepProfiler and phase_range (observe/profiler.py) around a tiny torch loop, with the phases
opened by MetricsLogger.timer as the training loop does: the trace holds the phases of the
profiled steps only, nothing is written when profiling is off, and a loop that stops inside the
range still writes what it recorded."""

import json

import torch

from megatron_dapo.config import ProfileConfig
from megatron_dapo.metrics_log import MetricsLogger
from megatron_dapo.observe.profiler import StepProfiler, phase_range


def _loop(prof: StepProfiler, log: MetricsLogger, steps) -> None:
    """A few matmuls per step under the phases "rollout" and "train", plus a phase named after
    the step (``only_step{N}``) to tell which steps the trace covers."""
    x = torch.randn(32, 32)
    for n in steps:
        prof.begin_step(n)
        with log.timer("rollout"):
            y = x @ x
        with log.timer("train"):
            y = (y @ x).relu()
        with phase_range(f"only_step{n}"):
            y.sum()
        prof.end_step(n)
        log.log(n, {})


def _event_names(path) -> set[str]:
    trace = json.loads(path.read_text())  # valid JSON (the chrome trace format)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name") for e in events}


def _logger(tmp_path) -> MetricsLogger:
    return MetricsLogger(tmp_path, tensorboard=False, wandb=False, wandb_project="", config={},
                         enabled=False, start_step=0)


def test_trace_covers_the_profiled_steps_only(tmp_path, caplog):
    prof = StepProfiler(ProfileConfig(steps=(2, 3)), tmp_path, rank=0)
    with caplog.at_level("INFO", logger="megatron_dapo.observe.profiler"):
        _loop(prof, _logger(tmp_path), range(1, 5))
    path = tmp_path / "profile" / "rank0_steps2-3.json"
    assert path.exists()
    names = _event_names(path)
    assert {"rollout", "train", "only_step2", "only_step3", "step_2", "step_3"} <= names
    assert not {"only_step1", "only_step4", "step_1", "step_4"} & names
    assert str(path) in caplog.text and "ui.perfetto.dev" in caplog.text
    prof.close()  # after the export: nothing more to do
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0_steps2-3.json"]


def test_off_writes_nothing(tmp_path):
    prof = StepProfiler(ProfileConfig(), tmp_path, rank=0)
    assert not prof.enabled
    _loop(prof, _logger(tmp_path), range(1, 4))
    prof.close()
    assert not (tmp_path / "profile").exists()


def test_close_inside_the_range_writes_the_partial_trace(tmp_path):
    with StepProfiler(ProfileConfig(steps=(2, 6)), tmp_path, rank=3) as prof:
        _loop(prof, _logger(tmp_path), range(1, 4))  # the loop stops after step 3
        assert not (tmp_path / "profile").exists()  # still recording
    names = _event_names(tmp_path / "profile" / "rank3_steps2-6.json")
    assert {"rollout", "train", "only_step2", "only_step3"} <= names and "only_step1" not in names


def test_error_in_a_step_exports(tmp_path):
    prof = StepProfiler(ProfileConfig(steps=(1, 2)), tmp_path, rank=0)
    try:
        with prof.step(1), phase_range("doomed"):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert "doomed" in _event_names(tmp_path / "profile" / "rank0_steps1-2.json")
    prof.begin_step(2)  # closed: never starts again
    assert prof._profile is None
