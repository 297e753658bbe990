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
