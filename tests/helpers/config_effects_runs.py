"""The runners of tests/functional/test_config_effects.py (its docstring says what they observe):
in-process runs through ``cli.main`` (``Runs``, each settings once), the 2-process runs in one
torchrun job (``run_dist``), and subprocess runs sent SIGTERM after their first step (``signalled``)."""

import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from megatron_dapo import cli
from megatron_dapo.mcore.parallel import destroy_parallel
from tests.helpers.records import records as run_records

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "conf" / "cpu_tiny.yaml")
BASE = {"toy.warmup_steps": "40", "toy.num_train": "200", "toy.num_val": "8", "toy.num_attention_heads": "2",
        "toy.num_key_value_heads": "1", "train.total_steps": "1", "eval.every": "0", "eval.before_train": "false",
        "checkpoint.save_every": "0", "logging.tensorboard": "false", "data.prompts_per_step": "4",
        "data.gen_prompts_per_batch": "8", "train.mini_batch_prompts": "2", "eval.n": "1",
        "reward.num_workers": "0", "algorithm.filter_groups.enable": "false"}


@dataclasses.dataclass
class Result:
    rc: int | None
    out: str
    err: str
    logs: str
    error: str  # an exception that escaped cli.main
    dir: Path
    threads: int = 0

    @property
    def records(self) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith("timing_s/")}
                for r in run_records(self.dir)]

    @property
    def last(self) -> dict:
        return (self.records or [{}])[-1]

    @property
    def files(self) -> set[str]:
        skip = ("toy/", "toy_data/", "toy_base/")
        return {str(p.relative_to(self.dir)) for p in self.dir.rglob("*")
                if p.is_file() and not str(p.relative_to(self.dir)).startswith(skip)} if self.dir.exists() else set()

    def ckpt(self, name: str = "checkpoint.json") -> dict:
        from megatron_dapo.mcore.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.dir / "checkpoints")
        return json.loads((latest / name).read_text()) if latest else {}


def _fmt(value: str, **paths) -> str:
    return value.format(**{k: str(v) for k, v in paths.items()})


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train_in_process(run_dir: Path, args: list[str], env: dict) -> Result:
    lines, logger = _Lines(), logging.getLogger("megatron_dapo")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    out, err, rc, error = io.StringIO(), io.StringIO(), None, ""
    try:
        with mock.patch.dict(os.environ, env), mock.patch("megatron_dapo.plotting.plot_run", lambda d: None), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["train", "--config", CONFIG, *args])
    except Exception as e:  # noqa: BLE001 - a run that fails is an observation too
        error = f"{type(e).__name__}: {e}"
    finally:
        destroy_parallel()  # the next run starts torch.distributed and megatron's groups afresh
        logger.removeHandler(lines)
        logger.level = level
    return Result(rc, out.getvalue(), err.getvalue(), "\n".join(lines.lines), error, run_dir, torch.get_num_threads())


class Runs:
    """Runs by their settings, each once: a reference shared by several keys runs once."""

    def __init__(self, root: Path):
        self.root, self.base, self.cache = root, root / "base", {}
        self.data = root / "mixed.jsonl"

    def args(self, settings: dict, run_dir: Path) -> list[str]:
        merged = BASE | {"logging.dir": str(run_dir)} | {k: v for k, v in settings.items() if not k.startswith("_")}
        return [f"{k}={_fmt(v, base=self.base, data=self.data, root=self.root, run=run_dir)}"
                for k, v in merged.items()]

    def prepare(self, settings: dict, run_dir: Path) -> None:
        run_dir.mkdir(parents=True)
        if settings.get("_copy") == "all":
            shutil.copytree(self.base, run_dir, dirs_exist_ok=True)
        elif not any(k.startswith("toy.") or k == "seed" for k in settings):  # the same toy: reuse the base
            for name in ("toy", "toy_data", "toy_base"):
                shutil.copytree(self.base / name, run_dir / name)

    def __call__(self, settings: dict, env: tuple = ()) -> Result:
        key = (tuple(sorted(settings.items())), env)
        if key not in self.cache:
            run_dir = self.root / f"run{len(self.cache)}"
            self.prepare(settings, run_dir)
            self.cache[key] = train_in_process(run_dir, self.args(settings, run_dir), dict(env))
        return self.cache[key]


def make_runs(root: Path) -> Runs:
    """The module's base run (the toy made once), a data file with bad rows and duplicates, and the
    decimal-answer files, under ``root``."""
    import pyarrow.parquet as pq

    r = Runs(root)
    base = train_in_process(r.base, r.args({}, r.base), {})
    assert base.rc == 0, base.err[-3000:] + base.error
    r.cache[((), ())] = base
    rows = pq.read_table(r.base / "toy_data" / "train.parquet").to_pylist()[:24]
    long = json.loads(json.dumps(rows[0]))
    long["prompt"][0]["content"] = "Largest digit of " + "1" * 60 + "?"  # more than 64 tokens, fewer than 100
    lines = [json.dumps(x) for x in rows[:2]] + ["{not json"] + [json.dumps(x) for x in rows[2:] + rows[:6] + [long]]
    r.data.write_text("\n".join(lines) + "\n")  # 6 duplicates, a bad row at line 3, a long prompt
    for split, rows in (("train", rows), ("val", pq.read_table(r.base / "toy_data" / "val.parquet").to_pylist())):
        for row in rows:
            row["reward_model"]["ground_truth"] += ".0"
        (r.root / f"decimal_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return r


DRIVER = """
import contextlib, io, json, logging, os, sys
from megatron_dapo import cli
from megatron_dapo.mcore.parallel import destroy_parallel
import megatron_dapo.plotting
megatron_dapo.plotting.plot_run = lambda d: None
logger = logging.getLogger("megatron_dapo")
for run in json.load(open(sys.argv[1])):
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out, err, rc, error = io.StringIO(), io.StringIO(), None, ""
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["train", "--config", run["config"], *run["args"]])
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    logger.removeHandler(handler)
    destroy_parallel(process_group=False)
    if os.environ["RANK"] == "0":
        result = dict(rc=rc, out=out.getvalue(), err=err.getvalue(), logs="\\n".join(lines), error=error)
        open(run["result"], "w").write(json.dumps(result))
destroy_parallel()
"""


def run_dist(runs: Runs, wanted: list[dict]) -> dict:
    """Each of these settings as a 2-process run, all in one torchrun job driving them in turn (vLLM
    last); {frozenset(settings.items()): Result}."""
    spec = []
    for i, settings in enumerate(sorted(wanted, key=lambda s: s.get("rollout.engine", "") == "vllm")):
        run_dir = runs.root / f"dist{i}"
        runs.prepare(settings, run_dir)
        spec.append(dict(config=CONFIG, args=runs.args(settings, run_dir), result=str(run_dir) + ".json",
                         settings=settings))
    (runs.root / "spec.json").write_text(json.dumps(spec))
    (runs.root / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(runs.root / "driver.py"), str(runs.root / "spec.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return {frozenset(run["settings"].items()): Result(**json.loads(Path(run["result"]).read_text()),
                                                       dir=Path(run["result"][:-5])) for run in spec}


def signalled(runs: Runs, *settings: dict) -> list[Result]:
    """Subprocess trainers (side by side), each sent SIGTERM once its first step is logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = []
    for i, s in enumerate(settings):
        run_dir = runs.root / f"signalled{len(list(runs.root.glob('signalled*')))}"
        runs.prepare(s, run_dir)
        procs.append((run_dir, subprocess.Popen([sys.executable, "-m", "megatron_dapo.cli", "train", "--config", CONFIG,
                                                 *runs.args(s, run_dir)], cwd=ROOT, env=env, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    # Each run is watched at once, not one after the other: a run that starts faster than the one
    # before it could otherwise finish every step before its turn to be signalled.
    waiting, deadline = dict(procs), time.time() + 120
    while waiting:
        for run_dir, proc in list(waiting.items()):
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and metrics.read_text():
                proc.send_signal(signal.SIGTERM)
                del waiting[run_dir]
            else:
                assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    results = []
    for run_dir, proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(Result(proc.returncode, out, err, err, "", run_dir))
    return results
