"""A tiny byte-level BPE tokenizer with a ChatML-style chat template, built offline in memory.

Byte-level BPE encodes any text (LaTeX, unicode) and decodes it back exactly, so tests can
compare decoded ids with the expected templated string. The template mimics Qwen2.5's ChatML
layout without its default system prompt.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "Solve the following math problem step by step.",
    "The last line of your response should be of the form Answer: $Answer (without quotes).",
    "Remember to put your answer on its own line after \"Answer:\".",
    "Find the largest possible real part of (75+117i)z + 96/z where |z| = 4.",
    "user assistant system answer problem the of and to",
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders, written out in Python as an independent expectation."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def build_tiny_tokenizer(vocab_size: int = 400, chat_template: str | None = CHAT_TEMPLATE
                         ) -> PreTrainedTokenizerFast:
    """A fresh tokenizer; pass chat_template=None for one without a template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    hf.chat_template = chat_template
    return hf
