"""prepare-data: the downloaded files -> deduplicated DAPO-schema files, counted; bad rows named."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo import cli
from megatron_dapo.data import load_prompts


def _row(problem: str, answer: str, index: str) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": problem}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule"}, "extra_info": {"index": index}}


@pytest.fixture
def raw(tmp_path):
    """A DAPO-Math-17K-shaped file: 3 unique prompts in 7 rows, copies with other extra_info."""
    rows = [_row(p, a, f"id-{i}") for i, (p, a) in enumerate(
        [("1+1?", "2"), ("2+2?", "4"), ("1+1?", "2"), ("3+3?", "6"), ("1+1?", "2"), ("2+2?", "4"), ("3+3?", "6")])]
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_train_and_aime_files_come_out_deduplicated_and_counted(raw, aime_path, tmp_path, capsys):
    out = tmp_path / "prepared"
    rc = cli.main(["prepare-data", "--train", str(raw), "--eval", str(aime_path), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "train: 7 rows -> 3 unique prompts (4 duplicate rows merged)" in text
    assert "eval: 960 rows -> 30 unique prompts (930 duplicate rows merged)" in text
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"], r["extra_info"]["num_copies"])
            for r in train] == [("1+1?", "2", 3), ("2+2?", "4", 2), ("3+3?", "6", 2)]
    assert train[0]["extra_info"]["index"] == "id-0"  # the first copy's metadata
    again = load_prompts(out / "eval.parquet")  # the trainer's loader reads the output unchanged
    assert (again.num_rows, again.num_duplicates, len(again.records)) == (30, 0, 30)
    assert {r.ground_truth for r in again.records} == {r.ground_truth for r in load_prompts(aime_path).records}
    report = json.loads((out / "prepare.json").read_text())
    assert [(r["split"], r["rows"], r["unique_prompts"]) for r in report] == [("train", 7, 3), ("eval", 960, 30)]


def test_a_bad_row_is_named_and_nothing_is_written(raw, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row("5+5?", "10", "a")) + "\n" + json.dumps({"prompt": "not a list"}) + "\n")
    out = tmp_path / "prepared"
    rc = cli.main(["prepare-data", "--train", str(raw), str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}" in err and "line 2" in err and "'prompt'" in err, err
    assert not out.exists()
    rc = cli.main(["prepare-data", "--train", str(raw), str(bad), "--out", str(out), "--on-bad-row", "skip"])
    text = capsys.readouterr().out
    assert rc == 0 and "9 rows -> 4 unique prompts" in text and "1 bad row(s) skipped" in text, text


def test_an_existing_output_is_not_replaced_without_force(raw, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert cli.main(["prepare-data", "--train", str(raw), "--out", str(out)]) == 0
    assert cli.main(["prepare-data", "--train", str(raw), "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert cli.main(["prepare-data", "--train", str(raw), "--out", str(out), "--force"]) == 0


def test_a_long_read_says_how_far_it_is(tmp_path, monkeypatch, capsys):
    """DAPO-Math-17K's 1.79M rows take ~40 s to read: progress lines on stderr (here every 10,000
    rows, the interval set to 0), then the write, then the report on stdout."""
    from megatron_dapo.data import prepare

    monkeypatch.setattr(prepare, "PROGRESS_EVERY_S", 0.0)
    rows = [_row(f"{i % 500}+1?", str(i % 500 + 1), f"id-{i}") for i in range(25_000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert cli.main(["prepare-data", "--train", str(path), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert [line.split(" rows read")[0] for line in lines[:2]] == ["prepare-data: --train: 10,000",
                                                                   "prepare-data: --train: 20,000"]
    assert lines[2] == f"prepare-data: writing {tmp_path / 'out' / 'train.parquet'} (500 prompts)"
    assert "train: 25000 rows -> 500 unique prompts" in out.replace(",", "")
