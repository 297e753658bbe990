"""A ~150-token Qwen2-style tokenizer for the toy task, saved in the same HF layout as Qwen2.5's.

The CPU demo loads it with ``transformers.AutoTokenizer.from_pretrained(dir)`` and renders prompts
with ``apply_chat_template``: the code path used for Qwen. That path decides the design. When the
directory's config.json says ``model_type: qwen2``, transformers 5 ignores the pipeline stored in
tokenizer.json and rebuilds Qwen2's own (NFC, Qwen's split regex, byte-level, BPE) from the
stored vocab and merges, so a word-level or character-level model would be silently replaced.
This tokenizer therefore IS a byte-level BPE with Qwen2's exact pipeline, only with a tiny vocabulary:

* alphabet: the byte-level symbols of tab, newline, carriage return and printable ASCII (98 of
  the 256; other bytes cannot be encoded and are dropped, as by any BPE without an unk token);
* merges: every word of the toy task (and the chat roles) becomes one token, built by a chain
  of merges (L+a, La+r, ...), checked at build time;
* special tokens last, as in Qwen2.5: <|endoftext|> (eos and pad), <|im_start|>, <|im_end|>.

Like Qwen, digits are always single tokens and a space before a digit is its own token ("G").

Files written by ``save_toy_tokenizer``: tokenizer.json, tokenizer_config.json (with the
``chat_template`` inside, as in the Qwen2.5 repositories), special_tokens_map.json. An assistant
turn ends with <|im_end|>, so generation must stop on it as well as on <|endoftext|>
(``generation_config.eos_token_id`` lists both, as Qwen2.5-Instruct's does). Deviation: the chat
template has no default system message (Qwen2.5 adds "You are Qwen, ..."), which would only cost
prompt tokens here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from megatron_dapo.toy import task as toy_task

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)
ROLES = ("system", "user", "assistant")

# Qwen2.5's ChatML layout, without its default system prompt (see the module docstring).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX (the "pre_tokenizer" of Qwen2.5's tokenizer.json).
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_ALPHABET_BYTES = (0x09, 0x0A, 0x0D, *range(0x20, 0x7F))


def _byte_symbol(b: int) -> str:
    """GPT-2 / Qwen byte-level symbol of byte ``b`` (printable ASCII maps to itself)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(0x100 + sum(1 for x in range(b) if x not in printable))


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_vocab_and_merges(texts: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Alphabet, then one chain of merges per multi-symbol piece of ``texts`` (and the roles).

    Order is fixed (alphabet by byte, pieces by first appearance), so the ids are a pure function
    of ``texts``. Special tokens are not included; they are added after the merged pieces.
    """
    pre = _pre_tokenizer()
    vocab = {_byte_symbol(b): i for i, b in enumerate(_ALPHABET_BYTES)}
    merges: list[tuple[str, str]] = []
    for text in (*ROLES, *texts):
        for piece, _ in pre.pre_tokenize_str(text):
            if piece in vocab:
                continue
            if any(ch not in vocab for ch in piece):
                raise ValueError(f"toy tokenizer text must be printable ASCII, got {piece!r} in {text!r}")
            for end in range(2, len(piece) + 1):
                if piece[:end] not in vocab:
                    merges.append((piece[: end - 1], piece[end - 1]))
                    vocab[piece[:end]] = len(vocab)
    return vocab, merges


def build_toy_tokenizer(texts: Iterable[str] | None = None):
    """The toy tokenizer as a transformers fast tokenizer (not yet saved).

    Args:
        texts: texts whose words become single tokens; None = ``toy_task.vocabulary_texts()``.
    """
    from transformers import PreTrainedTokenizerFast  # heavy import, only when used

    texts = list(toy_task.vocabulary_texts() if texts is None else texts)
    vocab, merges = build_vocab_and_merges(texts)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                 additional_special_tokens=[IM_START, IM_END], model_max_length=4096,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    _check_words_are_single_tokens(hf, vocab, texts)
    return hf


def _check_words_are_single_tokens(hf, vocab: dict[str, int], texts: list[str]) -> None:
    """A later merge chain can capture a pair of an earlier word and split it; fail loudly if so."""
    for text in (*ROLES, *texts):
        for piece, _ in _pre_tokenizer().pre_tokenize_str(text):
            ids = hf.backend_tokenizer.model.tokenize(piece)
            if len(ids) != 1 and piece in vocab:
                raise AssertionError(f"toy tokenizer splits {piece!r} into {[t.value for t in ids]}; "
                                     "reorder or rename the task words")


def save_toy_tokenizer(out_dir: str | Path, texts: Iterable[str] | None = None) -> Path:
    """Writes the tokenizer files into ``out_dir`` (created if needed); returns ``out_dir``.

    tokenizer_config.json is written directly rather than by ``save_pretrained`` so that the chat
    template sits inside it, as in the Qwen2.5 repositories (recent transformers would write a
    separate chat_template.jinja), and the files do not depend on the transformers version.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = build_toy_tokenizer(texts)
    hf.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END]}
    added = {str(hf.convert_tokens_to_ids(t)): {"content": t, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        **special,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": hf.model_max_length,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special)
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=True) + "\n", encoding="ascii")
