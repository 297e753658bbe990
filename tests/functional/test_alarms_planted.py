"""A planted reward hack is seen: the alarms fire, the warning is printed, the dumps hold it.

The run is the real loop in a child process (tests/helpers/planted.py): the HF engine with a quarter
of its responses replaced by ``Answer: Answer: <right digit>``, trained with a scorer that accepts
that format (``planted_easy``: our value scorer, plus every prompt whose answer is 9 called solved),
audited by the paper's rule, which rejects it. The training set is 12 toy prompts, so prompts come
back within a step and the ledger's curation (data.skip_solved_after=1) retires the solved ones.
References: the plant's own rule (which responses it replaced, what it wrote) and the prompts'
ground truths, not the loop's bookkeeping.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_dapo import cli
from megatron_dapo.observe.rows import alarm_file, read_rows, step_file
from tests.helpers.demo import CPU_TINY, LAUNCHER_VARS, copy_demo_base
from tests.helpers.planted import EASY_ANSWER, PLANT_EVERY
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS, MAX_SAMPLES = 3, 16
DRIVER = "from tests.helpers.planted import register; register(); import sys; from megatron_dapo.cli import main; " \
         "sys.exit(main(sys.argv[1:]))"


def _small_train_set(run_dir: Path) -> Path:
    """12 toy prompts, 4 of them with the answer 9 (the planted scorer's solved ones)."""
    table = pq.read_table(run_dir / "toy_data" / "train.parquet").to_pylist()
    easy = [r for r in table if r["reward_model"]["ground_truth"] == EASY_ANSWER][:4]
    rest = [r for r in table if r["reward_model"]["ground_truth"] != EASY_ANSWER][:8]
    path = run_dir / "small_train.parquet"
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(easy + rest), path)
    return path


@pytest.fixture(scope="module")
def run(demo_base, tmp_path_factory) -> dict:
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("planted") / "run")
    train = _small_train_set(run_dir)
    args = ["train", "--config", str(CPU_TINY), f"logging.dir={run_dir}", "toy.enable=false",
            f"model.hf_path={run_dir / 'toy_base'}", f"data.train_files=[{train}]",
            f"data.val_files=[{run_dir / 'toy_data' / 'val.parquet'}]", "rollout.engine=planted_hf",
            "reward.fn=planted_easy", "reward.num_workers=0", "alarms.audit_fn=math_dapo_paper",
            "rollout.check_logprob_mismatch=false", "data.skip_solved_after=1", f"train.total_steps={STEPS}",
            "eval.every=0", "eval.before_train=false", "checkpoint.save_every=0", "logging.tensorboard=false",
            f"alarms.max_samples={MAX_SAMPLES}", "algorithm.filter_groups.max_num_gen_batches=20"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return {"dir": run_dir, "out": out, "records": records(run_dir)}


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


def test_the_regular_dump_flags_exactly_the_plants(run):
    rows = read_rows(step_file(run["dir"], 1))
    assert rows and {r.phase for r in rows} == {"train"}
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
