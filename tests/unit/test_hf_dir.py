"""model.hf_path checked at the door (megatron_dapo/hf_dir.py): each way an HF dir can be broken is
one InputError naming the file and the fix; an intact dir reads as transformers reads it."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.config import ToyConfig
from megatron_dapo.errors import InputError
from megatron_dapo.hf_dir import read_hf_dir

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
            warmup_steps=1, num_train=40, num_val=8)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from megatron_dapo.toy.base import make_toy_base

    return make_toy_base(tmp_path_factory.mktemp("hf") / "hf", seed=0, cfg=ToyConfig(**TINY))


def test_an_intact_dir_reads_as_transformers_reads_it(good):
    from transformers import AutoTokenizer, GenerationConfig

    hf = read_hf_dir(good, weights=True)
    assert hf.config == json.loads((good / "config.json").read_text())
    ref = AutoTokenizer.from_pretrained(good)
    assert hf.tokenizer("Answer: 12")["input_ids"] == ref("Answer: 12")["input_ids"]
    eos = GenerationConfig.from_pretrained(good).eos_token_id
    assert hf.stops == sorted(set(eos if isinstance(eos, list) else [eos]))


def _edit_config(**change):
    def go(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(change)
        (path / "config.json").write_text(json.dumps(cfg))
    return go


def _truncate(path):
    blob = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(blob[: len(blob) - 100])


def _int8(path):
    tensors = load_file(path / "model.safetensors")
    save_file({k: v.to(torch.int8) for k, v in tensors.items()}, path / "model.safetensors")


def _shards(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _unlink(*names):
    return lambda path: [(path / n).unlink() for n in names]


CASES = {  # name -> (change, weights checked, the message holds)
    "config.json not JSON": (lambda p: (p / "config.json").write_text("{ nope"), False, "config.json is not readable "
                             "JSON"),
    "config.json a list": (lambda p: (p / "config.json").write_text("[1]"), False, "config.json holds a JSON list"),
    "another architecture": (_edit_config(model_type="llama4"), False, "'llama4'"),
    "a size missing": (_edit_config(hidden_size=None), False, "hidden_size"),
    "no tokenizer files": (_unlink("tokenizer.json", "tokenizer_config.json"), False, "no tokenizer there"),
    "tokenizer not JSON": (lambda p: (p / "tokenizer.json").write_text("{ nope"), False, "the tokenizer does not load"),
    "vocab_size below the tokenizer's": (_edit_config(vocab_size=4), False, "more than config.json's vocab_size=4"),
    "no weights": (_unlink("model.safetensors"), True, "expected model.safetensors or"),
    "truncated weights": (_truncate, True, "model.safetensors is truncated"),
    "int8 weights": (_int8, True, "model.safetensors holds I8 tensors"),
    "index naming an absent shard": (_shards, True, "names 1 shard(s) not in the dir: model-00002-of-00002"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_dir_is_one_input_error_naming_the_file(good, tmp_path, name):
    change, weights, expected = CASES[name]
    path = tmp_path / "hf"
    shutil.copytree(good, path)
    change(path)
    with pytest.raises(InputError) as e:
        read_hf_dir(path, weights=weights)
    message = str(e.value)
    assert message.startswith(f"model.hf_path={path}: ") and expected in message, message
    assert "\n" not in message


def test_weights_are_read_only_when_asked(good, tmp_path):
    """A resumed run (vLLM engine) never reads model.hf_path's safetensors: a dir without them is fine."""
    path = tmp_path / "hf"
    shutil.copytree(good, path)
    (path / "model.safetensors").unlink()
    assert read_hf_dir(path, weights=False).config["vocab_size"] > 0
