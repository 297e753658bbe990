"""The toy tokenizer loads like Qwen's (AutoTokenizer + chat template) and round-trips the task."""

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from megatron_dapo.data import apply_chat_template
from megatron_dapo.reward import compute_score
from megatron_dapo.toy import task as toy_task
from megatron_dapo.toy import tokenizer as toy_tokenizer

# What a Qwen2 checkpoint directory holds next to the tokenizer. transformers 5 picks the
# tokenizer class from model_type and rebuilds Qwen2's pipeline, so the test must include it.
_QWEN2_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 140,
                 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = toy_tokenizer.save_toy_tokenizer(tmp_path_factory.mktemp("toy_tok"))
    (out / "config.json").write_text(json.dumps(_QWEN2_CONFIG))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


def render(messages, add_generation_prompt=True):
    """ChatML written out by hand, as an independent expectation of the template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_files_match_the_qwen_layout(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == toy_tokenizer.CHAT_TEMPLATE
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    special = json.loads((tok_dir / "special_tokens_map.json").read_text())
    assert special["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]


def test_small_vocabulary_with_qwen_special_tokens(tok):
    assert len(tok) < 200
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [len(tok) - 3, len(tok) - 2, len(tok) - 1]  # last, as in Qwen2.5


def test_chat_template_prompt_round_trips(tok):
    messages = [{"role": "user", "content": toy_task.format_question([3, 7, 1, 9, 4])}]
    ids = apply_chat_template(tok, messages)
    assert tok.decode(ids) == render(messages)
    assert ids == tok(render(messages), add_special_tokens=False)["input_ids"]
    assert len(ids) <= 20  # prompts must stay short on CPU


def test_task_words_are_single_tokens_and_digits_are_spelled_out(tok):
    for word in ("Largest", " digit", " of", "Check", "Answer", "user", "assistant"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    assert tok.tokenize(" 37194") == ["\u0120", "3", "7", "1", "9", "4"]  # Qwen: space, then digits


@pytest.mark.parametrize("reasoning", [False, True])
def test_response_decodes_to_text_the_reward_fn_scores(tok, reasoning):
    response = toy_task.format_response([3, 7, 1, 9, 4], 9, reasoning=reasoning) + "<|im_end|>"
    ids = tok(response, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids) == response
    assert compute_score(tok.decode(ids, skip_special_tokens=True), "9")["acc"] is True


def test_any_printable_ascii_round_trips(tok):
    text = "Hello, World! {x} = [1, 2]; a_b ~ `c` \"q\" 'z'\n\tend"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_stored_pipeline_equals_the_one_transformers_rebuilds(tok, tok_dir):
    # transformers 4.x uses tokenizer.json as stored; 5.x rebuilds Qwen2's pipeline: same ids.
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = render([{"role": "user", "content": "Largest digit of 90210?"}])
    text += "Check 90210.\nAnswer: 9<|im_end|>"
    assert raw.encode(text).ids == tok(text, add_special_tokens=False)["input_ids"]


def test_build_is_deterministic(tmp_path):
    a = toy_tokenizer.save_toy_tokenizer(tmp_path / "a")
    b = toy_tokenizer.save_toy_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_non_ascii_task_text_is_rejected():
    with pytest.raises(ValueError, match="printable ASCII"):
        toy_tokenizer.build_vocab_and_merges(["Gr\u00f6\u00dfte Ziffer"])
