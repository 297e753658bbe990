"""The HF model dir a run reads (``model.hf_path``), checked at the door: everything it must hold
is opened and checked in seconds, before a model is built, and each problem is one InputError
naming the file and the fix, not a traceback after the model was built
(benchmarks/bad_input_campaign.py tries each).

What is read: config.json (a JSON object, an architecture the trainer implements), the tokenizer
(it loads, its vocabulary fits the model's ``vocab_size``), generation_config.json's stop ids and,
when the run starts from these weights, the safetensors: the single file or the index and every
shard it names, each header parsed and its length checked against the file's size (a truncated
download), and floating-point tensors only (a quantised export would load as garbage).
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.convert.safetensors_io import INDEX_NAME, SINGLE_NAME
from megatron_dapo.errors import InputError, one_line

FLOAT_DTYPES = ("F32", "BF16", "F16")  # what the loader casts to the training dtype
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, BPE


@dataclass
class HFDir:
    path: Path
    config: dict
    tokenizer: Any
    stops: list[int]


def read_hf_dir(path: str | Path, *, weights: bool) -> HFDir:
    """``model.hf_path``'s config, tokenizer and stop ids; ``weights``: also check the safetensors
    (the run starts from them). InputError on the first problem."""
    path = Path(path)
    where = f"model.hf_path={path}"
    config = read_config(path, where)
    tokenizer, stops = _tokenizer(path, where)
    if len(tokenizer) > config["vocab_size"]:
        raise InputError(f"{where}: the tokenizer has {len(tokenizer)} tokens, more than config.json's vocab_size="
                         f"{config['vocab_size']}: the tokenizer belongs to another model; copy the model's own")
    if weights:
        check_weights(path, where)
    return HFDir(path, config, tokenizer, stops)


def read_config(path: Path, where: str) -> dict:
    """config.json of an HF dir, a JSON object of an architecture the trainer implements."""
    if not (path / "config.json").is_file():
        raise InputError(f"{where}: no config.json there; point it at an HF model dir "
                         "(config.json, tokenizer, safetensors)")
    config = _read_json(path / "config.json", where)
    _check_architecture(config, where)
    return config


def _read_json(file: Path, where: str) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{where}: {file.name} is not readable JSON ({one_line(e)}); download it again") from None
    if not isinstance(value, dict):
        raise InputError(f"{where}: {file.name} holds a JSON {type(value).__name__}, not an object; download it again")
    return value


def _check_architecture(config: dict, where: str) -> None:
    from megatron_dapo.convert import supported_architectures
    from megatron_dapo.mcore.model import hf_arch

    try:
        hf_arch(config)
    except (KeyError, TypeError, ValueError) as e:  # ConversionError is a ValueError
        what = f"lacks {e}" if isinstance(e, KeyError) else one_line(e)
        raise InputError(f"{where}: config.json {what}; the trainer implements {', '.join(supported_architectures())} "
                         f"(this config: architectures {config.get('architectures')}, model_type "
                         f"{config.get('model_type')!r})") from None


def _tokenizer(path: Path, where: str) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer, GenerationConfig

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"{where}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); copy the model's "
                         "tokenizer files into the dir")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, JSON errors, ... for one problem
        raise InputError(f"{where}: the tokenizer does not load ({type(e).__name__}: {one_line(e)}); the dir needs "
                         "the model's tokenizer files (tokenizer.json, tokenizer_config.json)") from None
    try:
        gen = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
    except Exception as e:  # noqa: BLE001 - as above
        raise InputError(f"{where}: generation_config.json does not load ({one_line(e)})") from None
    if not getattr(tokenizer, "chat_template", None):  # every prompt goes through it (data/tokenize.py)
        raise InputError(f"{where}: the tokenizer has no chat_template (tokenizer_config.json or "
                         "chat_template.jinja); use the model's own tokenizer files")
    eos = gen.eos_token_id if gen is not None and gen.eos_token_id is not None else tokenizer.eos_token_id
    if eos is None:
        raise InputError(f"{where}: no end-of-sequence token (neither generation_config.json's eos_token_id nor "
                         "the tokenizer's): generation could not stop")
    return tokenizer, sorted(set(eos if isinstance(eos, list) else [eos]))


def check_weights(path: Path, where: str) -> None:
    """Every safetensors file the dir's weights need: present, header readable, not truncated,
    floating-point tensors."""
    if (path / INDEX_NAME).is_file():
        index = _read_json(path / INDEX_NAME, where)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{where}: {INDEX_NAME} has no weight_map; download it again")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise InputError(f"{where}: {INDEX_NAME} names {len(missing)} shard(s) not in the dir: "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; finish the download")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if len(files) != 1:
            found = f"found {files}" if files else "found none"
            raise InputError(f"{where}: expected {SINGLE_NAME} or {INDEX_NAME} with its shards, {found}; download "
                             "the weights (safetensors), or start from model.checkpoint=")
    for name in files:
        _check_shard(path / name, where)


def _check_shard(file: Path, where: str) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: {file.name} is not a readable safetensors file ({one_line(e)}); "
                         "download it again") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 8 + header_len + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size < end:
        raise InputError(f"{where}: {file.name} is truncated ({size} bytes, its header needs {end}); "
                         "download it again")
    odd = sorted({v["dtype"] for v in tensors.values()} - set(FLOAT_DTYPES))
    if odd:
        first = next(k for k, v in tensors.items() if v["dtype"] in odd)
        raise InputError(f"{where}: {file.name} holds {'/'.join(odd)} tensors (e.g. {first}); the trainer loads "
                         f"{'/'.join(FLOAT_DTYPES)} weights: use the unquantised model")
