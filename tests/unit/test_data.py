"""Prompt loading: the real AIME-2024 file, and small DAPO-shaped parquet/JSONL files written here."""

import json
import logging
import random
import re
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import DAPO_PROMPT_TEMPLATE, Message, format_dapo_prompt, load_prompts
from megatron_dapo.errors import InputError

# The parquet layout of BytedTsinghua-SIA/DAPO-Math-17k, explicit so null fields keep their types.
DAPO_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])


def dapo_row(problem, ground_truth, uid="u"):
    """A row as in DAPO-Math-17K, with the prompt text built by hand (not by the library)."""
    content = ("Solve the following math problem step by step. The last line of your response should "
               "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
               f"problem.\n\n{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")
    return {"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": ground_truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": uid}}


def write_parquet(path, rows, row_group_size=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), path, row_group_size=row_group_size)
    return path


def write_jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


# --- AIME-2024 -------------------------------------------------------------------------------


def test_template_matches_every_aime_row_byte_for_byte(aime_path):
    rows = pq.read_table(aime_path).to_pylist()
    assert len(rows) == 960
    for row in rows:
        assert len(row["prompt"]) == 1
        expected = Message(role=row["prompt"][0]["role"], content=row["prompt"][0]["content"])
        assert format_dapo_prompt(row["extra_info"]["raw_problem"]) == (expected,)
    assert len({r["extra_info"]["raw_problem"] for r in rows}) == 30


def test_aime_loads_to_30_records_of_32_copies(aime_path):
    result = load_prompts(aime_path)
    assert (len(result.records), result.num_rows, result.num_duplicates, result.skipped) == (30, 960, 930, {})
    rows = pq.read_table(aime_path).to_pylist()
    truth_by_problem = {r["extra_info"]["raw_problem"]: r["reward_model"]["ground_truth"] for r in rows}
    for record in result.records:
        assert record.num_copies == 32
        raw_problem = record.extra_info["raw_problem"]
        assert record.messages == format_dapo_prompt(raw_problem)
        assert record.ground_truth == truth_by_problem[raw_problem]
        assert re.fullmatch(r"-?\d+", record.ground_truth)
        assert (record.data_source, record.ability) == ("math_dapo", "MATH")
        assert re.fullmatch(r"[0-9a-f]{16}", record.index)
    assert len({r.index for r in result.records}) == 30
    # Record order is first appearance in the file.
    first_seen = list(dict.fromkeys(r["extra_info"]["raw_problem"] for r in rows))
    assert [r.extra_info["raw_problem"] for r in result.records] == first_seen


def test_record_index_is_stable_under_row_order(aime_path, tmp_path):
    table = pq.read_table(aime_path)
    shuffled = table.take(list(reversed(range(table.num_rows))))
    pq.write_table(shuffled, tmp_path / "reversed.parquet")
    by_index = {r.index: r.messages for r in load_prompts(aime_path).records}
    by_index_reversed = {r.index: r.messages for r in load_prompts(tmp_path / "reversed.parquet").records}
    assert by_index == by_index_reversed


def test_template_constant_and_braces():
    assert DAPO_PROMPT_TEMPLATE.count("{problem}") == 1
    (message,) = format_dapo_prompt("Find {x} in \\frac{1}{2}.")
    assert "\n\nFind {x} in \\frac{1}{2}.\n\n" in message.content
    with pytest.raises(ValueError):
        format_dapo_prompt("  ")


# --- synthetic DAPO-Math-shaped parquet ------------------------------------------------------

NUM_UNIQUE = 50


def copies_of(i):
    return 1 + i % 7


def good_rows():
    rows = [dapo_row(f"Compute {i} + {i}.", str(2 * i), uid=f"{i}-{c}")
            for i in range(NUM_UNIQUE) for c in range(copies_of(i))]
    random.Random(0).shuffle(rows)
    return rows


def bad_rows():
    """(row, skip reason, field named in the error)."""
    no_role = dapo_row("No role.", "1")
    no_role["prompt"][0]["role"] = None
    empty = dapo_row("x", "1")
    empty["prompt"][0]["content"] = "  "
    no_truth = dapo_row("No truth.", "1")
    no_truth["reward_model"] = None
    null_truth = dapo_row("Null truth.", "1")
    null_truth["reward_model"]["ground_truth"] = None
    return [
        ({**dapo_row("p", "1"), "prompt": None}, "missing_prompt", "field 'prompt'"),
        ({**dapo_row("p", "1"), "prompt": []}, "bad_prompt", "field 'prompt'"),
        (no_role, "bad_prompt", "field 'prompt[0].role'"),
        (empty, "empty_content", "field 'prompt[0].content'"),
        (no_truth, "missing_ground_truth", "field 'reward_model.ground_truth'"),
        (null_truth, "missing_ground_truth", "field 'reward_model.ground_truth'"),
    ]


def test_parquet_skip_mode_counts_exactly(tmp_path):
    good = good_rows()
    conflict = [dapo_row("Conflict.", "1"), dapo_row("Conflict.", "1"), dapo_row("Conflict.", "2"),
                dapo_row("Conflict.", "1")]
    bad = [row for row, _, _ in bad_rows()]
    rows = good[:100] + conflict[:2] + bad + good[100:] + conflict[2:]
    path = write_parquet(tmp_path / "dapo.parquet", rows, row_group_size=37)
    result = load_prompts(path, on_bad_row="skip", batch_size=16)

    num_good = sum(copies_of(i) for i in range(NUM_UNIQUE))
    assert result.num_rows == num_good + 4 + 6
    assert len(result.records) == NUM_UNIQUE
    assert result.num_duplicates == num_good - NUM_UNIQUE
    assert result.skipped == {"conflicting_ground_truth": 4, "missing_prompt": 1, "bad_prompt": 2,
                              "empty_content": 1, "missing_ground_truth": 2}
    assert result.num_rows == sum(r.num_copies for r in result.records) + result.num_skipped
    for record in result.records:
        i = int(re.search(r"Compute (\d+) \+", record.messages[0].content).group(1))
        assert (record.ground_truth, record.num_copies) == (str(2 * i), copies_of(i))
        assert record.extra_info["index"].startswith(f"{i}-")


@pytest.mark.parametrize("case", range(6))
def test_parquet_error_names_file_row_and_field(tmp_path, case):
    bad_row, _, field_text = bad_rows()[case]
    rows = good_rows()[:23] + [bad_row] + good_rows()[:5]
    path = write_parquet(tmp_path / "bad.parquet", rows, row_group_size=10)
    with pytest.raises(ValueError) as err:
        load_prompts(path, batch_size=4)  # row 23 sits in the middle of a later batch
    assert str(err.value).startswith(f"{path}: row 23: {field_text}")


def test_parquet_conflict_error_names_both_rows(tmp_path):
    rows = [dapo_row("A.", "1"), dapo_row("Conflict.", "7"), dapo_row("A.", "1"), dapo_row("Conflict.", "8")]
    path = write_parquet(tmp_path / "conflict.parquet", rows)
    with pytest.raises(ValueError, match=r"row 3: field 'reward_model.ground_truth': '8' conflicts "
                                         r"with '7' for the same prompt at .*conflict.parquet: row 1"):
        load_prompts(path)


def test_parquet_without_dedup_keeps_every_row(tmp_path):
    path = write_parquet(tmp_path / "dapo.parquet", good_rows())
    result = load_prompts(path, dedup=False)
    num_good = sum(copies_of(i) for i in range(NUM_UNIQUE))
    assert (len(result.records), result.num_duplicates) == (num_good, 0)
    assert {r.num_copies for r in result.records} == {1}
    assert len({r.index for r in result.records}) == NUM_UNIQUE  # copies share the prompt id


def test_parquet_memory_is_bounded_by_unique_prompts(tmp_path):
    # 8000 rows of 4 unique ~5 kB prompts: decoded all at once they take ~50 MB of Python objects.
    problems = [f"Problem {i}: " + "x" * 5000 for i in range(4)]
    four = pa.Table.from_pylist([dapo_row(p, str(i)) for i, p in enumerate(problems)], schema=DAPO_SCHEMA)
    path = tmp_path / "big.parquet"
    pq.write_table(pa.concat_tables([four] * 2000), path, row_group_size=1000)
    tracemalloc.start()
    try:
        result = load_prompts(path, batch_size=500)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (len(result.records), result.num_duplicates) == (4, 7996)
    assert peak < 8 * 2**20, f"peak Python allocation {peak / 2**20:.1f} MiB"


# --- JSONL ----------------------------------------------------------------------------------

JSONL_LINES = [
    dapo_row("Five.", "5"),                                            # 1
    dapo_row("Five.", "5"),                                            # 2 duplicate of 1
    {"problem": "Twelve.", "answer": "12"},                            # 3 raw variant
    {"problem": "Nine.", "ground_truth": 9, "data_source": "custom"},  # 4 raw, int ground truth
    '{"prompt": [',                                                    # 5 broken JSON
    "[1, 2]",                                                          # 6 not an object
    {**dapo_row("S.", "1"), "prompt": "just a string"},                # 7
    {**dapo_row("F.", "1"), "reward_model": {"ground_truth": 1.5}},    # 8
    "",                                                                # 9 blank: not a row
    {"problem": "Both.", "answer": "1", "ground_truth": "2"},          # 10
    {"problem": "No answer."},                                         # 11
    {**dapo_row("E.", "1"), "extra_info": [1]},                        # 12
    dapo_row("Twelve.", "12"),                                         # 13 same prompt as line 3
]


def test_jsonl_skip_mode_counts_and_variants(tmp_path, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", JSONL_LINES)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data.loading"):
        result = load_prompts(path, on_bad_row="skip")
    assert (result.num_rows, len(result.records), result.num_duplicates) == (12, 3, 2)
    assert result.skipped == {"bad_json": 2, "bad_prompt": 1, "bad_ground_truth": 2,
                              "missing_ground_truth": 1, "bad_metadata": 1}
    five, twelve, nine = result.records
    assert (five.ground_truth, five.num_copies) == ("5", 2)
    assert twelve.messages == (Message("user", DAPO_PROMPT_TEMPLATE.replace("{problem}", "Twelve.")),)
    assert (twelve.ground_truth, twelve.num_copies) == ("12", 2)
    assert twelve.extra_info == {"raw_problem": "Twelve."}
    assert (twelve.data_source, twelve.ability) == ("math_dapo", "MATH")
    assert (nine.ground_truth, nine.data_source) == ("9", "custom")
    assert "Skipped 7 of 12 rows" in caplog.text and f"{path}: line 5: field '<line>'" in caplog.text


@pytest.mark.parametrize("line, field_text", [
    ('{"prompt": [', "field '<line>': invalid JSON"),
    ("[1, 2]", "field '<line>': expected a JSON object"),
    ({**dapo_row("S.", "1"), "prompt": "just a string"}, "field 'prompt'"),
    ({**dapo_row("F.", "1"), "reward_model": {"ground_truth": 1.5}}, "field 'reward_model.ground_truth'"),
    ({**dapo_row("T.", "1"), "reward_model": {"ground_truth": True}}, "field 'reward_model.ground_truth'"),
    ({"problem": "Both.", "answer": "1", "ground_truth": "2"}, "field 'answer'"),
    ({"problem": "No answer."}, "field 'answer'"),
    ({"problem": ""}, "field 'problem'"),
    ({"question": "Q?", "answer": "1"}, "field 'prompt'"),
    ({**dapo_row("E.", "1"), "data_source": 3}, "field 'data_source'"),
])
def test_jsonl_error_names_file_line_and_field(tmp_path, line, field_text):
    path = write_jsonl(tmp_path / "bad.jsonl", [dapo_row("Good.", "1"), "", line])
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}: line 3: {field_text}")


def test_invalid_utf8_line_is_a_bad_row(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(dapo_row("Good.", "1")).encode() + b"\n\xff\xfe\n")
    result = load_prompts(path, on_bad_row="skip")
    assert (len(result.records), result.skipped) == (1, {"bad_json": 1})


def test_duplicates_merge_across_files(tmp_path):
    parquet = write_parquet(tmp_path / "a.parquet", [dapo_row("Twelve.", "12"), dapo_row("Other.", "3")])
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"problem": "Twelve.", "answer": 12}])
    result = load_prompts([parquet, str(jsonl)])
    assert [(r.ground_truth, r.num_copies) for r in result.records] == [("12", 2), ("3", 1)]
    assert result.records[0].extra_info == {"index": "u"}  # first row's metadata wins


def test_file_and_argument_errors(tmp_path):
    with pytest.raises(InputError, match="prompt file not found: .*missing.parquet"):
        load_prompts(tmp_path / "missing.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(InputError, match="empty.parquet: not a readable parquet file"):
        load_prompts(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"question": ["1+1?"], "label": [2]}), tmp_path / "schema.parquet")
    with pytest.raises(InputError, match=r"schema.parquet: no 'prompt' or 'problem' column \(it has \['question', "
                       r"'label'\]\)"):
        load_prompts(tmp_path / "schema.parquet")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unknown prompt file extension '\.csv'.*\.parquet, \.jsonl"):
        load_prompts(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompts(tmp_path / "p.csv", on_bad_row="ignore")
    with pytest.raises(ValueError, match="at least one path"):
        load_prompts([])
