"""The CPU job run as a user runs it, for the fault and resume tests (tests/functional/test_faults.py,
test_async_save.py): the command, starting and killing it with its output in files, its records, and
the comparison with one uninterrupted reference run (the session's ``demo_reference`` fixture).

Every run is checked against the reference: each metrics record present exactly once and bitwise
equal (all values but wall times)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.demo import copy_demo_base
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
ARGS = [f"train.total_steps={STEPS}", "checkpoint.save_every=2", "eval.every=5", "logging.tensorboard=false"]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}


def train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
            f"logging.dir={run_dir}", *ARGS, *extra]


def run_train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(run_dir, *extra), cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)


def start_train(run_dir: Path, *extra: str) -> subprocess.Popen:
    """A trainer writing to files, not pipes: a process left behind would hold a pipe open and
    hang the reader instead of failing the test."""
    n = len(list(run_dir.parent.glob("launch_*.out")))
    out, err = (open(run_dir.parent / f"launch_{n}.{s}", "w+") for s in ("out", "err"))
    proc = subprocess.Popen(train_cmd(run_dir, *extra), cwd=ROOT, stdout=out, stderr=err, text=True, env=ENV)
    proc.out, proc.err = out, err
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[str, str]:
    proc.wait(timeout=timeout)
    texts = []
    for f in (proc.out, proc.err):
        f.seek(0)
        texts.append(f.read())
        f.close()
    return texts[0], texts[1]


def read_records(run_dir: Path) -> list[dict]:
    """The run's records so far, complete lines only: polled while the trainer writes or after a kill."""
    return records(run_dir)


def record_values(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith("timing_s/")} for r in records}


def assert_same_as_reference(run_dir: Path, reference: Path) -> None:
    got, want = read_records(run_dir), read_records(reference)
    assert [r["step"] for r in got] == list(range(STEPS + 1)), "each step's record exactly once"
    got_values, want_values = record_values(got), record_values(want)
    differ = {step: sorted(k for k in got_values[step].keys() | want_values.get(step, {}).keys()
                           if got_values[step].get(k) != want_values.get(step, {}).get(k))
              for step in got_values if got_values[step] != want_values.get(step)}
    assert not differ, f"records differ from the reference's (step: keys): {differ}"  # bitwise: floats with ==


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300, poll: float = 0.05) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {finish(proc)[1][-3000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def logged(run_dir: Path, step: int):
    return lambda: any(r["step"] >= step for r in read_records(run_dir))


def saving(run_dir: Path) -> bool:
    """Whether a save's temporary directory is there (a save is being written)."""
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.suffix == ".tmp" for p in ckpts.iterdir())


def wait_for_a_save(run_dir: Path, proc: subprocess.Popen) -> None:
    """Until a save's temporary directory appears: a kill now lands in the save."""
    wait_for(lambda: saving(run_dir), proc, "a checkpoint save", poll=0.001)


def wait_for_next_step(run_dir: Path, proc: subprocess.Popen) -> None:
    """Until the run logs a step past the last one recorded when called."""
    done = max([r["step"] for r in read_records(run_dir)], default=0)
    wait_for(logged(run_dir, done + 1), proc, "a step")


def kill_the_trainer(proc: subprocess.Popen) -> int:
    """SIGKILL to the trainer alone (not its process group); asserts it was killed, not finished,
    and that every process it had started is gone within 20 s. Returns how many it had."""
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill"
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left behind after the kill: {[p.cmdline() for p in alive]}"
    return len(children)


def make_reference(demo_base: Path, run_dir: Path) -> Path:
    """The uninterrupted run (copied from the session's demo base: it skips the warm-up)."""
    run_dir = copy_demo_base(demo_base, run_dir)
    out = run_train(run_dir)
    assert out.returncode == 0, out.stderr[-5000:]
    return run_dir


