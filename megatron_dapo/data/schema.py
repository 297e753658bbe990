"""Prompt records and the DAPO prompt template.

A `PromptRecord` is one unique training or evaluation prompt after loading and deduplication.
The DAPO data files (DAPO-Math-17K, AIME-2024) are in verl's parquet format: a `prompt` column
holding a list of {role, content} chat messages, a `reward_model.ground_truth` string, and
metadata columns `data_source`, `ability` and `extra_info`.

The template is copied from the DAPO README and the `prompt` column of
BytedTsinghua-SIA/DAPO `eval/aime-2024.parquet`; the unit tests check it byte for byte against
all 30 AIME-2024 problems in data/aime-2024.parquet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

DAPO_FILE = ("a DAPO-format parquet or JSONL file with rows (prompt, reward_model.ground_truth; or problem, "
             "answer)")  # what a prompt file must be, as error messages say it

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The single user message of every DAPO prompt; `{problem}` is replaced by the problem text."""


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat message, as in the `prompt` column of the DAPO parquet files."""

    role: str
    """Speaker: "user" in all DAPO data; "system" or "assistant" are accepted as well."""
    content: str
    """The message text, non-empty."""

    def as_dict(self) -> dict[str, str]:
        """The {role, content} dict that HF `apply_chat_template` expects."""
        return {"role": self.role, "content": self.content}


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One unique prompt with its reference answer, after deduplication."""

    messages: tuple[Message, ...]
    """The chat prompt, not yet wrapped in the model's chat template."""
    ground_truth: str
    """Reference answer as a string (an integer string such as "-3" in DAPO-Math)."""
    data_source: str
    """Routes the response to a reward function; "math_dapo" for DAPO data."""
    ability: str
    """Task family label carried over from the file ("MATH" for DAPO data)."""
    extra_info: dict[str, Any] = dataclasses.field(hash=False)
    """The file's `extra_info` of the first row that had this prompt (other copies may differ)."""
    index: str
    """Stable id: the first 16 hex digits of `prompt_key(messages)`, whatever the row order or file."""
    num_copies: int
    """How many identical rows of the input were merged into this record."""

    def chat(self) -> list[dict[str, str]]:
        """The messages as plain dicts, for a tokenizer's chat template or for JSON."""
        return [m.as_dict() for m in self.messages]


def format_dapo_prompt(problem: str) -> tuple[Message, ...]:
    """Wrap a raw problem statement in the DAPO template as a one-message user prompt.

    Returns a tuple so the result compares equal to `PromptRecord.messages`.
    """
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"problem must be a non-empty string, got {problem!r}")
    # str.replace, not str.format: problems contain LaTeX braces such as \frac{a}{b}.
    return (Message(role="user", content=DAPO_PROMPT_TEMPLATE.replace("{problem}", problem)),)


def prompt_key(messages: tuple[Message, ...]) -> str:
    """Hex SHA-256 of the exact roles and contents: the dedup key and the source of record ids.

    JSON encoding keeps message boundaries unambiguous ("a" + "bc" differs from "ab" + "c").
    """
    payload = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
