"""prepare-data: the downloaded files -> deduplicated DAPO-schema files, counted; bad rows named."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo import cli
from megatron_dapo.data import load_prompts
from megatron_dapo.errors import InputError


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


def test_a_bad_rows_advice_names_the_knob_of_the_command_that_read_it(tmp_path, capsys):
    """prepare-data has a flag for skipping, a run a config key: each error names its own."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "not a list"}) + "\n")
    assert cli.main(["prepare-data", "--train", str(bad), "--out", str(tmp_path / "prepared")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("(fix the row, or pass --on-bad-row skip to count and drop bad rows)"), err
    assert "data.on_bad_row" not in err and len(err.splitlines()) == 1
    with pytest.raises(InputError, match=r"\(fix the row, or set data.on_bad_row=skip to count and drop bad rows\)$"):
        load_prompts(bad)  # as a run's data loading calls it


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


def test_non_integer_ground_truths_are_counted_and_warned_about(raw, tmp_path, capsys):
    """The reward scores a non-integer ground truth by exact string match, not by value (module
    docstring): kept, but counted in the report and named in a one-line warning with the fix."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(_row(p, a, p)) + "\n" for p, a in
                             [("half?", "\\frac{1}{2}"), ("tenth?", "0.1"), ("again half?", "\\frac{1}{2}"),
                              ("ten?", "10"), ("thousand?", "1,000")]))
    out = tmp_path / "prepared"
    rc = cli.main(["prepare-data", "--train", str(raw), str(mixed), "--out", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("prepare-data: warning: --train: 3 of 8 prompts have a ground truth that is not "
                                  "an integer ('\\frac{1}{2}', '0.1'); the reward matches those as normalised "
                                  "strings, not by value"), warnings[0]
    assert "check that this is the file you meant, or drop those prompts" in warnings[0], warnings[0]
    assert "8 unique prompts (4 duplicate rows merged, 3 with a non-integer ground truth)" in text, text
    report = json.loads((out / "prepare.json").read_text())
    assert report[0]["non_integer_ground_truths"] == 3
    assert len(pq.read_table(out / "train.parquet")) == 8  # kept: the reward does score them
    rc = cli.main(["prepare-data", "--train", str(raw), "--out", str(tmp_path / "ints")])
    assert rc == 0 and "warning" not in capsys.readouterr().err  # integers, as in DAPO-Math-17K
