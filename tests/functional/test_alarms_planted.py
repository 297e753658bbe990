"""A planted reward hack is seen: the alarms fire, the warning is printed, the dumps hold it.

The run is the real loop in a child process (tests/helpers/planted.py): the HF engine with a quarter
of its responses replaced by ``Answer: Answer: <right digit>``, trained with a scorer that accepts
that format (``planted_easy``: our value scorer, plus every prompt whose answer is 9 called solved),
audited by the paper's rule, which rejects it. The training set is 12 toy prompts (evaluation: 8), so
prompts come back within a step and the ledger's curation (data.skip_solved_after=1) retires the solved
ones.
References: the plant's own rule (which responses it replaced, what it wrote) and the prompts'
ground truths, not the loop's bookkeeping.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo import cli
from megatron_dapo.observe.rows import alarm_file, read_rows, step_file
from tests.helpers.demo import CPU_TINY, LAUNCHER_VARS, copy_demo_base
from tests.helpers.planted import EASY_ANSWER, PLANT_EVERY, RUN_OVERRIDES
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS, STOP, MAX_SAMPLES = 3, 2, 16
DRIVER = "from tests.helpers.planted import register; register(); import sys; from megatron_dapo.cli import main; " \
         "sys.exit(main(sys.argv[1:]))"


def _small_train_set(run_dir: Path) -> Path:
    """12 toy prompts, 4 of them with the answer 9 (the planted scorer's solved ones)."""
    table = pq.read_table(run_dir / "toy_data" / "train.parquet").to_pylist()
    easy = [r for r in table if r["reward_model"]["ground_truth"] == EASY_ANSWER][:4]
    rest = [r for r in table if r["reward_model"]["ground_truth"] != EASY_ANSWER][:8]
    path = run_dir / "small_train.parquet"
    pq.write_table(pa.Table.from_pylist(easy + rest), path)
    val = pq.read_table(run_dir / "toy_data" / "val.parquet").to_pylist()[:8]
    pq.write_table(pa.Table.from_pylist(val), run_dir / "small_val.parquet")
    return path


def _args(run_dir: Path, train: Path, steps: int) -> list[str]:
    return ["train", "--config", str(CPU_TINY), f"logging.dir={run_dir}", "toy.enable=false",
            f"model.hf_path={run_dir / 'toy_base'}", f"data.train_files=[{train}]",
            f"data.val_files=[{run_dir / 'small_val.parquet'}]", *(f"{k}={v}" for k, v in RUN_OVERRIDES.items()),
            "reward.num_workers=0", "alarms.audit_fn=math_dapo_paper", "data.skip_solved_after=1",
            f"train.total_steps={steps}",
            "eval.every=1", "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false",
            f"alarms.max_samples={MAX_SAMPLES}", "algorithm.filter_groups.max_num_gen_batches=20"]


def _train(run_dir: Path, train: Path, steps: int) -> subprocess.CompletedProcess:
    # The clean-clone CI saw this child abort twice at exit, after a complete run ("terminate called
    # without an active exception", rc -6), the second time with the tokenizer's threads off: the
    # cause was the run's gloo group left alive (cli._end_megatron now tears it down).
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", DRIVER, *_args(run_dir, train, steps)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def run(demo_base, tmp_path_factory) -> dict:
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("planted") / "run")
    train = _small_train_set(run_dir)
    out = _train(run_dir, train, STEPS)
    return {"dir": run_dir, "out": out, "records": records(run_dir), "train": train}


@pytest.fixture(scope="module")
def resumed(run, demo_base, tmp_path_factory) -> Path:
    """The same run stopped after step STOP (its end: the checkpoint a stop signal writes too) and
    rerun to STEPS: curation has retired prompts by then, so the resume carries a live ledger. Every
    step is evaluated, so the stopped run's final evaluation is one the reference makes too."""
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("planted_resumed") / "run")
    for name in ("small_train.parquet", "small_val.parquet"):
        shutil.copy(run["dir"] / name, run_dir / name)
    train = run_dir / "small_train.parquet"
    _train(run_dir, train, STOP)
    _train(run_dir, train, STEPS)
    return run_dir


def test_the_planted_format_raises_its_alarms_at_the_first_step(run):
    events = [json.loads(line) for line in (run["dir"] / "alarms.jsonl").read_text().splitlines()]
    first = {e["alarm"]: e for e in events if e["step"] == 1}
    assert {"repeated_answer_label", "scorer_disagreement"} <= first.keys(), events
    # Raised once, not again while it stays raised.
    assert sum(e["alarm"] == "repeated_answer_label" for e in events) == 1
    assert "alarm repeated_answer_label at step 1" in run["out"].stderr
    rec = run["records"][0]
    planted = len(range(0, 8, PLANT_EVERY)) / 8  # k = 0, 4 of G = 8
    assert planted <= rec["alarm/repeated_answer_label"] <= planted + 0.05
    assert rec["alarm/scorer_disagreement"] >= planted  # every plant: value scorer yes, paper no
    assert rec["alarm/num_raised"] >= 2


def test_the_alarm_dump_holds_the_planted_responses(run):
    for step in range(1, STEPS + 1):  # dumped every step while raised
        rows = read_rows(alarm_file(run["dir"], step, "repeated_answer_label"))
        assert len(rows) == MAX_SAMPLES
        assert all(r.response.startswith("Answer: Answer: ") and r.response_index % PLANT_EVERY == 0 for r in rows)
        assert all(r.acc and r.audit_acc is False for r in rows if r.ground_truth != EASY_ANSWER)
        assert any(r.advantage is not None for r in rows if r.kept)  # trained ones carry their advantage


def test_the_regular_dump_flags_exactly_the_plants(run):
    rows = [r for r in read_rows(step_file(run["dir"], 1)) if r.phase == "train"]
    assert rows
    planted = [r for r in rows if r.response_index % PLANT_EVERY == 0]
    assert len(planted) == len(rows) // 4
    for r in planted:
        assert "repeated_answer_label" in r.flags, r
        assert r.response == f"Answer: Answer: {r.ground_truth}" and r.pred == r.ground_truth
        assert r.audit_scorer == "math_dapo_paper" and r.audit_pred != r.ground_truth
    # The base's own responses: a repeated label is rare (measured 0.5% over a demo step).
    assert sum("repeated_answer_label" in r.flags for r in rows if r not in planted) <= 2


def test_the_ledger_retires_solved_prompts_and_skips_them(run):
    last = run["records"][-1]
    # 4 prompts answer 9: every response correct at their first draw, retired, then skipped.
    assert last["ledger/retired"] == 4
    assert last["ledger/skipped_total"] > 0
    assert last["ledger/prompts_seen"] == 12
    assert last["ledger/pass_rate_1"] >= 4 / 12


def test_samples_command_reads_the_flagged_responses(run, capsys):
    assert cli.main(["samples", str(run["dir"]), "--step", "1", "--where", "flagged", "--n", "3"]) == 0
    shown = capsys.readouterr().out
    assert shown.count(">> Answer: Answer: ") == 3


def test_a_resume_with_curation_on_equals_the_uninterrupted_run(run, resumed):
    def values(run_dir):
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith("timing_s/")} for r in records(run_dir)]

    def state(run_dir):
        return json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())

    stopped = json.loads((resumed / "checkpoints" / f"step_{STOP:08d}" / "trainer_state.json").read_text())
    assert stopped["ledger"]["skipped_total"] > 0 and stopped["alarms"], "the resume would not carry curation"
    assert values(resumed) == values(run["dir"])  # bitwise
    assert state(resumed)["ledger"] == state(run["dir"])["ledger"]
    assert state(resumed)["alarms"] == state(run["dir"])["alarms"]
    dumps = [{p.name: p.read_bytes() for p in (d / "samples").iterdir()} for d in (resumed, run["dir"])]
    assert dumps[0] == dumps[1]
    assert (resumed / "alarms.jsonl").read_text() == (run["dir"] / "alarms.jsonl").read_text()
