"""The tests' reader of a run's metrics.jsonl (tests/helpers/records.py), which they poll while a
trainer appends to it, or read after a kill: a last line still being written, or cut by the kill, is
not a record yet and must not fail the test that polls."""

import json

from tests.helpers.records import records


def test_a_half_written_last_line_is_not_read(tmp_path):
    assert records(tmp_path) == []  # before the trainer opens the file
    whole = [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps({"step": 2, "x": 3.0})[:9])
    assert records(tmp_path) == whole
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps({"step": 2, "x": 3.0}) + "\n")
    assert [r["step"] for r in records(tmp_path)] == [0, 1, 2]  # complete once its newline is there
