"""Turn prompt messages into token ids with a Hugging Face tokenizer, and drop overlong prompts.

DAPO wraps each prompt in the model's chat template with the assistant turn opened
(`apply_chat_template(..., add_generation_prompt=True)`, DAPO README; verl does the same), so
the token ids end where the model's answer starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_dapo.data.loading import LoadResult
from megatron_dapo.data.schema import DAPO_FILE, Message, PromptRecord

logger = logging.getLogger(__name__)

FALLBACK_CHOICES = (None, "plain")


def apply_chat_template(tokenizer: Any, messages: Sequence[Message | Mapping[str, str]], *,
                        fallback: str | None = None) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template, ending with the generation prompt.

    Args:
        tokenizer: a transformers tokenizer (PreTrainedTokenizerBase).
        messages: `Message`s or {role, content} dicts.
        fallback: what to do when the tokenizer has no chat template. None raises ValueError;
            "plain" joins the contents with blank lines and encodes that text with the
            tokenizer's usual special tokens (e.g. a BOS token), for base models without a
            template.
    """
    if fallback not in FALLBACK_CHOICES:
        raise ValueError(f"fallback must be one of {FALLBACK_CHOICES}, got {fallback!r}")
    chat = [m.as_dict() if isinstance(m, Message) else {"role": m["role"], "content": m["content"]}
            for m in messages]
    if not chat:
        raise ValueError("cannot tokenize an empty list of messages")
    if getattr(tokenizer, "chat_template", None) is None:
        if fallback == "plain":
            return list(tokenizer.encode("\n\n".join(m["content"] for m in chat), add_special_tokens=True))
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat_template; set one, or pass "
                         "fallback='plain' to encode the joined message contents")
    out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    # transformers 5.x returns a BatchEncoding (return_dict=True is its default); 4.x a list.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    ids = list(out)
    if not all(isinstance(i, int) for i in ids):
        raise TypeError(f"expected a flat list of token ids from apply_chat_template, got {ids[:3]!r}...")
    return ids


def tokenize_prompts(tokenizer: Any, records: Sequence[PromptRecord], *,
                     fallback: str | None = None) -> list[list[int]]:
    """`apply_chat_template` for each record, in order."""
    return [apply_chat_template(tokenizer, r.messages, fallback=fallback) for r in records]


def filter_by_prompt_length(records: Sequence[PromptRecord], token_ids: Sequence[Sequence[int]],
                            max_prompt_length: int) -> tuple[list[PromptRecord], list[list[int]], int]:
    """Keep prompts of at most `max_prompt_length` tokens.

    Prompts are dropped rather than truncated: a truncated math problem has a wrong ground
    truth (verl's `data.filter_overlong_prompts=True` also drops them).

    Returns:
        (kept records, their token ids, number dropped), order preserved.
    """
    if len(records) != len(token_ids):
        raise ValueError(f"{len(records)} records but {len(token_ids)} token id lists")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    kept = [(r, list(ids)) for r, ids in zip(records, token_ids) if len(ids) <= max_prompt_length]
    num_dropped = len(records) - len(kept)
    logger.info("Kept %d of %d prompts; dropped %d longer than %d tokens", len(kept), len(records),
                num_dropped, max_prompt_length)
    return [r for r, _ in kept], [ids for _, ids in kept], num_dropped


def no_prompts_message(key: str, files: Sequence[Any], loaded: LoadResult, lengths: Sequence[int],
                       max_prompt_length: int) -> str:
    """The one-line error for ``files`` (config key ``key``) leaving no prompt, with the fix for its
    cause: prompts that were read but are all too long need a larger limit, named from their
    measured ``lengths`` (tokens with the chat template, one per loaded record), not other data."""
    where = f"{key}={','.join(map(str, files))}: no usable prompts"
    skipped = f", {loaded.num_skipped} skipped as bad" if loaded.num_skipped else ""
    lengths = sorted(lengths)
    if len(lengths) == 1:  # records were read, so every one is over the limit
        return (f"{where} ({loaded.num_rows} rows{skipped}; its one prompt has {lengths[0]} tokens with the chat "
                f"template, over data.max_prompt_length={max_prompt_length}); raise data.max_prompt_length to at "
                f"least {lengths[0]}")
    if lengths:
        median = lengths[(len(lengths) - 1) // 2]
        return (f"{where} ({loaded.num_rows} rows{skipped}; all {len(lengths)} prompts are longer than "
                f"data.max_prompt_length={max_prompt_length} tokens with the chat template: shortest {lengths[0]}, "
                f"median {median}, longest {lengths[-1]}); raise data.max_prompt_length to at least {median} "
                f"(keeps half of them or more; {lengths[-1]} keeps all)")
    reasons = (": " + ", ".join(f"{r} {n}" for r, n in sorted(loaded.skipped.items()))) if loaded.skipped else ""
    return f"{where} ({loaded.num_rows} rows{skipped}{reasons}); point {key} at {DAPO_FILE}"
