"""The toy base: a Qwen2 checkpoint that knows the response format but not the answers."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.toy import base as toy_base
from megatron_dapo.toy import task as toy_task
from megatron_dapo.toy import tokenizer as toy_tokenizer

# A reduced warm-up (one narrow layer, 60 steps: ~3 s on one core) with the same recipe as the
# default; the default's own numbers are in docs/training.md.
SMALL = dataclasses.replace(toy_base.ToyConfig(), hidden_size=32, intermediate_size=64, num_layers=1,
                            warmup_steps=60, warmup_batch_size=32, warmup_lr=1e-2)


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models run faster on one thread, and much faster when other jobs share the cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, one_thread):
    _, val = toy_task.make_splits(seed=1, num_train=10, num_val=64, num_digits=SMALL.num_digits)
    return toy_base.make_toy_base(tmp_path_factory.mktemp("toy_base"), seed=1, cfg=SMALL, eval_rows=val)


def test_base_knows_the_format_but_not_the_answers(base_dir):
    report = json.loads((base_dir / "warmup.json").read_text())["eval_temperature_1"]
    assert report["format_rate"] >= 0.9  # parsable "Answer: <int>" lines
    assert report["acc_mean"] <= 0.25  # chance is 0.1: a random digit


def test_checkpoint_is_a_qwen2_with_gqa_and_qkv_bias(base_dir):
    config = json.loads((base_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    weights = load_file(base_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    assert ("lm_head.weight" in weights) != config["tie_word_embeddings"]
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_generation_stops_on_im_end_and_endoftext(base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    gen_config = json.loads((base_dir / "generation_config.json").read_text())
    stops = tok.convert_tokens_to_ids([toy_tokenizer.IM_END, toy_tokenizer.EOS])
    assert gen_config["eos_token_id"] == stops == toy_base.stop_token_ids(tok)
    assert gen_config["pad_token_id"] == tok.pad_token_id


def test_reloaded_model_answers_in_format(base_dir, one_thread):
    """Greedy answers of the saved checkpoint through the HF rollout engine (the package's one sampler)."""
    from transformers import AutoTokenizer

    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(base_dir)
    engine = HFEngine.from_pretrained(str(base_dir))
    questions = ["Largest digit of 31415?", "Largest digit of 27182?"]
    stops = toy_base.stop_token_ids(tok)
    out = engine.generate(toy_base.batch_prompt_ids(tok, questions), 1,
                          SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=tuple(stops), seed=0))
    for (rollout,) in out:
        assert rollout.finish_reason == "stop" and rollout.response_ids[-1] in stops
        assert tok.decode(rollout.response_ids, skip_special_tokens=True).splitlines()[-1].startswith("Answer: ")
        assert all(lp <= 0 for lp in rollout.logprobs)


def test_same_seed_same_weights(tmp_path, one_thread):
    quick = dataclasses.replace(SMALL, warmup_steps=3)
    a = toy_base.make_toy_base(tmp_path / "a", seed=5, cfg=quick)
    b = toy_base.make_toy_base(tmp_path / "b", seed=5, cfg=quick)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_warmup_prompt_shortcut_equals_the_chat_template_path(base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    questions = [toy_task.format_question(d) for d in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [0, 0, 0, 0, 7])]
    assert toy_base._fast_prompt_ids(tok, questions) == toy_base.batch_prompt_ids(tok, questions)
