"""The CPU demo under torchrun with separate placement (4 processes: ranks 0-1 train at DP=2,
ranks 2-3 hold two HF engine replicas), for the asynchronous-rollout tests: a whole run, or one
started in a session of its own and acted on (a signal, a kill) after a given record."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers.demo import LAUNCHER_VARS, copy_demo_base
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
SEPARATE = ["rollout.placement=separate", "rollout.num_ranks=2", "train.old_log_probs=trainer",
            "logging.tensorboard=false"]
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def command(run_dir: Path, *overrides: str, module: str = "megatron_dapo.cli",
            config: str = "cpu_tiny.yaml") -> list[str]:
    """``module``: the CLI, or a test's module that registers its pieces and runs it; ``config``:
    under conf/ (the vLLM demo's is cpu_tiny_vllm.yaml)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
            module, "train", "--config", str(ROOT / "conf" / config), f"logging.dir={run_dir}",
            *SEPARATE, *overrides]


def run(run_dir: Path, *overrides: str, module: str = "megatron_dapo.cli", env: dict | None = None,
        config: str = "cpu_tiny.yaml") -> str:
    """A whole run (exit 0 asserted); its output."""
    out = subprocess.run(command(run_dir, *overrides, module=module, config=config), cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env={**ENV, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def reference_run(demo_base: Path, tmp_path_factory, name: str, *overrides: str) -> Path:
    """An uninterrupted run in a fresh dir (the demo's base copied in): what a resume must equal."""
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp(name) / "run")
    run(run_dir, *overrides)
    return run_dir


def values(recs: list[dict]) -> dict[int, dict]:
    """Each record without its wall times and memory: what an uninterrupted run must equal."""
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith(("timing_s/", "memory/"))}
            for r in recs}


def start_then(run_dir: Path, overrides: list[str], after_step: int, act, *, module: str = "megatron_dapo.cli",
               env: dict | None = None, config: str = "cpu_tiny.yaml") -> tuple[int, str]:
    """Starts the run in a session of its own, waits for this launch's record of ``after_step`` (a
    killed launch's later records stay until the next one resumes), then ``act(launcher)``; (the
    launcher's exit status, its output)."""
    log = run_dir.parent / f"{run_dir.name}.out"
    with open(log, "w") as out:
        launched = time.time()
        agent = subprocess.Popen(command(run_dir, *overrides, module=module, config=config), cwd=ROOT,
                                 stdout=out, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                 start_new_session=True)
        deadline = launched + 600
        while not any(r["step"] >= after_step and r["time"] >= launched for r in records(run_dir)):
            assert agent.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.02)
        act(agent)
        agent.wait(timeout=600)
    return agent.returncode, log.read_text()


def stall_then_stop(run_dir: Path, overrides: list[str], *, config: str = "cpu_tiny.yaml", stall: int = 6,
                    saves: int = 5) -> tuple[int, str]:
    """Runs with the stalling engines (tests/helpers/stalling_engine.py; ``overrides`` name one, one
    generation batch a step and no evaluation, so that an engine's call k is step k's batch), step
    ``stall``'s batch stalling until aborted (``STALL_CALL``); once step ``stall - 2``'s record is
    there (step ``stall - 1``'s batch has started on the engines), sends SIGTERM to every rank and
    waits for the stop's checkpoint of step ``saves``. (the launcher's exit status, its output)

    The stall is an engine's call number, not a file the test creates after a record: a file came
    too late when the engines had finished the next batch before the record (steps of ~0.2 s) and
    started the one after it at once (a CI run of 8b3c50b, docs/verification.md)."""
    latest = run_dir / "checkpoints" / "latest"

    def act(agent) -> None:
        stop_every_rank(agent)
        deadline = time.time() + 300
        while not (latest.is_file() and latest.read_text().strip() == f"step_{saves:08d}"):
            assert agent.poll() is None and time.time() < deadline, f"the trainers did not save step {saves}"
            time.sleep(0.05)

    return start_then(run_dir, overrides, stall - 2, act, module="tests.helpers.stalling_engine",
                      env={"STALL_CALL": str(stall)}, config=config)


def cut_in_generation(run_dir: Path, overrides: list[str], *, stall: int, after_step: int, saves: int,
                      config: str = "cpu_tiny.yaml") -> tuple[int, str]:
    """Runs with the stalling engines (``overrides`` name one), the engines' call ``stall`` stalling
    until aborted; once step ``after_step``'s record is there and both engine ranks stall, sends
    SIGTERM to every rank and waits for the launcher's end: the stop cuts the step short and saves
    step ``saves`` (asserted). (the launcher's exit status, its output)"""
    log = run_dir.parent / f"{run_dir.name}.out"

    def act(agent) -> None:
        deadline = time.time() + 300
        while log.read_text().count(f"call {stall} stalls") < 2:
            assert agent.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        stop_every_rank(agent)

    status, text = start_then(run_dir, overrides, after_step, act, module="tests.helpers.stalling_engine",
                              env={"STALL_CALL": str(stall)}, config=config)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saves:08d}", text[-3000:]
    return status, text


def cancel_at_budget_end(run_dir: Path, engine: str, *overrides: str, config: str = "cpu_tiny.yaml") -> None:
    """A run whose generation budget (200; 16 prompts x 8 responses a step) is spent in step 2 while
    the batches of steps 3 and 4, asked for in step 1 (staleness 3; requests 4 and 5 after the first
    weight version and step 1's own batch), are generated but not collected: the engines generated
    them before step 1's weights went in (a weight version waits for every batch asked before it).
    Asserts that the trainers cancelled both and every engine rank dropped their results, and that
    the run ended with step 2's record and its evaluation."""
    log = run(run_dir, f"rollout.engine={engine}", "rollout.max_staleness=3", "algorithm.filter_groups.enable=false",
              "data.gen_prompts_per_batch=16", "train.generation_budget=200", "train.total_steps=8",
              "checkpoint.save_every=0", "eval.every=0", "eval.before_train=false", *overrides, config=config)
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2] and "eval/avg@4" in recs[-1], recs
    dropped = re.findall(r"engine rank (\d): generation request (\d) cancelled, its result dropped", log)
    assert sorted(dropped) == [("0", "4"), ("0", "5"), ("1", "4"), ("1", "5")], log[-3000:]


def stop_every_rank(agent) -> None:
    """SIGTERM to each of the launcher's 4 workers, as SLURM signals every task of a job step."""
    workers = psutil.Process(agent.pid).children()
    ranks = sorted(p.environ().get("RANK") for p in workers)
    assert ranks == ["0", "1", "2", "3"], ranks
    for worker in workers:
        worker.send_signal(signal.SIGTERM)


def kill_all(agent) -> None:
    """SIGKILL to the launcher, every rank and their reward workers, waited for. torchrun starts each
    rank in a session of its own: a kill of the launcher's process group leaves the ranks running
    (they then finish the run, and a resume test would compare an uninterrupted run with itself)."""
    procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
