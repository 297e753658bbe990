"""`megatron-dapo score --data F`: the reward self-check on a data set's own answers."""

import json

from megatron_dapo import cli


def _score(capsys, path, *overrides: str) -> tuple[int, str, str]:
    rc = cli.main(["score", "--data", str(path), "reward.num_workers=0", *overrides])
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(path, answers):
    path.write_text("".join(json.dumps({"problem": f"p{i}?", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def test_nothing_to_check_is_an_error_not_an_empty_table(tmp_path, capsys):
    """No row, or no integer ground truth: nothing was checked, so no table and no exit code 0."""
    rc, out, err = _score(capsys, _rows(tmp_path / "fractions.jsonl", ["\\frac{1}{2}", "0.5"]))
    assert rc == 2 and "form" not in out, out
    line = err.strip()
    assert line.startswith("megatron-dapo: error: ") and "\n" not in line, err
    assert "none of its 2 ground truths is an integer ('\\frac{1}{2}', '0.5')" in line, line
    assert "integer-answer data such as DAPO-Math-17K or AIME" in line, line
    (tmp_path / "empty.jsonl").write_text("")
    rc, out, err = _score(capsys, tmp_path / "empty.jsonl")
    assert rc == 2 and "nothing to self-check (0 rows)" in err and "\n" not in err.strip(), err


def test_non_integer_ground_truths_are_counted_as_not_checked(tmp_path, capsys):
    rc, out, err = _score(capsys, _rows(tmp_path / "mixed.jsonl", ["42", "\\frac{1}{2}"]))
    assert rc == 0, out + err
    assert "(0 duplicates merged, 0 skipped, 1 with a non-integer ground truth not checked)" in out, out
    assert "mis-scored in all: 0" in out, out
