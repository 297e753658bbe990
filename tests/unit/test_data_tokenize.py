"""Chat-template tokenisation and the prompt-length filter, with a tiny offline tokenizer."""

import logging

import pytest

from megatron_dapo.data import (
    Message,
    PromptRecord,
    apply_chat_template,
    filter_by_prompt_length,
    format_dapo_prompt,
    load_prompts,
    tokenize_prompts,
)
from tests.helpers.tiny_tokenizer import build_tiny_tokenizer, render_chat


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def aime_records(aime_path):
    return load_prompts(aime_path).records


def make_record(problem):
    return PromptRecord(messages=format_dapo_prompt(problem), ground_truth="1", data_source="math_dapo",
                        ability="MATH", extra_info={}, index=problem, num_copies=1)


def test_aime_prompts_decode_to_the_templated_text(tokenizer, aime_records):
    for record in aime_records:
        ids = apply_chat_template(tokenizer, record.messages)
        expected_text = render_chat(record.chat())
        assert tokenizer.decode(ids) == expected_text
        # Same ids as encoding the rendered text directly: the template adds nothing else.
        assert ids == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
        generation_prompt = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        assert ids[-len(generation_prompt):] == generation_prompt


def test_messages_as_dicts_or_dataclasses_and_non_ascii(tokenizer):
    messages = (Message("system", "Be brief."), Message("user", "Is \u00e9 = \u2211 \\frac{1}{2}?"))
    ids = apply_chat_template(tokenizer, messages)
    assert ids == apply_chat_template(tokenizer, [m.as_dict() for m in messages])
    assert all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nIs \u00e9 = \u2211 \\frac{1}{2}?<|im_end|>\n<|im_start|>assistant\n")


def test_missing_chat_template_raises_unless_plain_fallback():
    tokenizer = build_tiny_tokenizer(chat_template=None)
    messages = (Message("system", "Be brief."), Message("user", "What is 1 + 1?"))
    with pytest.raises(ValueError, match="no chat_template.*fallback='plain'"):
        apply_chat_template(tokenizer, messages)
    ids = apply_chat_template(tokenizer, messages, fallback="plain")
    assert tokenizer.decode(ids) == "Be brief.\n\nWhat is 1 + 1?"
    with pytest.raises(ValueError, match="fallback"):
        apply_chat_template(tokenizer, messages, fallback="raw")


def test_length_filter_keeps_exactly_the_short_prompts(caplog):
    records = [make_record(f"p{i}") for i in range(5)]
    token_ids = [[0] * n for n in (3, 5, 5, 6, 10)]
    with caplog.at_level(logging.INFO, logger="megatron_dapo.data.tokenize"):
        kept, kept_ids, num_dropped = filter_by_prompt_length(records, token_ids, max_prompt_length=5)
    assert [r.index for r in kept] == ["p0", "p1", "p2"]  # length == max is kept
    assert [len(ids) for ids in kept_ids] == [3, 5, 5]
    assert num_dropped == 2
    assert "dropped 2 longer than 5 tokens" in caplog.text
    with pytest.raises(ValueError, match="5 records but 4"):
        filter_by_prompt_length(records, token_ids[:4], max_prompt_length=5)


def test_length_filter_on_tokenized_aime(tokenizer, aime_records):
    token_ids = tokenize_prompts(tokenizer, aime_records)
    lengths = [len(ids) for ids in token_ids]
    limit = sorted(lengths)[14]
    kept, kept_ids, num_dropped = filter_by_prompt_length(aime_records, token_ids, limit)
    expected = [r.index for r, n in zip(aime_records, lengths) if n <= limit]
    assert [r.index for r in kept] == expected
    assert num_dropped == 30 - len(expected) and 0 < num_dropped < 30
    assert all(len(ids) <= limit for ids in kept_ids)


def _load_for_run(key, files, tokenizer, *, max_prompt_length, on_bad_row="error"):
    """run._prompts, the trainer's reading of data.train_files / data.val_files."""
    from types import SimpleNamespace

    from megatron_dapo import run

    data = SimpleNamespace(on_bad_row=on_bad_row, max_prompt_length=max_prompt_length)
    return run._prompts(key, files, tokenizer, data, dedup=True)


def test_prompts_all_too_long_ask_for_a_larger_limit_not_other_data(tokenizer, aime_records, aime_path):
    """Every prompt over data.max_prompt_length: the data is fine, the limit is not, and the error
    names the limit that would let them in (measured, with the chat template)."""
    lengths = sorted(len(ids) for ids in tokenize_prompts(tokenizer, aime_records))
    with pytest.raises(ValueError) as e:
        _load_for_run("data.val_files", [str(aime_path)], tokenizer, max_prompt_length=lengths[0] - 1)
    msg = str(e.value)
    assert f"all 30 prompts are longer than data.max_prompt_length={lengths[0] - 1} tokens" in msg, msg
    assert f"shortest {lengths[0]}, median {lengths[14]}, longest {lengths[-1]}" in msg, msg
    assert f"raise data.max_prompt_length to at least {lengths[14]}" in msg, msg
    assert "DAPO-format" not in msg and "\n" not in msg, msg
    assert _load_for_run("data.val_files", [str(aime_path)], tokenizer, max_prompt_length=lengths[14])[0]  # half in


def test_prompts_of_the_wrong_shape_point_at_dapo_format_data(tokenizer, tmp_path):
    """Rows that are all bad (skipped): other data is the fix, and the error says why they were skipped."""
    path = tmp_path / "floats.jsonl"
    path.write_text('{"problem": "1+1?", "answer": 2.0}\n' * 2)
    with pytest.raises(ValueError) as e:
        _load_for_run("data.train_files", [str(path)], tokenizer, max_prompt_length=1024, on_bad_row="skip")
    msg = str(e.value)
    assert "no usable prompts (2 rows, 2 skipped as bad: bad_ground_truth 2); point data.train_files at a " \
           "DAPO-format parquet or JSONL file" in msg, msg
    assert "max_prompt_length" not in msg, msg
