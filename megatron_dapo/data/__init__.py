"""Prompt data: loading DAPO parquet/JSONL files, chat-template tokenisation, index sampling."""

from megatron_dapo.data.loading import LoadResult, load_prompts
from megatron_dapo.data.sampler import PromptSampler
from megatron_dapo.data.schema import DAPO_PROMPT_TEMPLATE, Message, PromptRecord, format_dapo_prompt
from megatron_dapo.data.tokenize import (
    apply_chat_template,
    filter_by_prompt_length,
    no_prompts_message,
    tokenize_prompts,
)

__all__ = [
    "DAPO_PROMPT_TEMPLATE",
    "LoadResult",
    "Message",
    "PromptRecord",
    "PromptSampler",
    "apply_chat_template",
    "filter_by_prompt_length",
    "format_dapo_prompt",
    "load_prompts",
    "no_prompts_message",
    "tokenize_prompts",
]
