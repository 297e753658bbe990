"""A benchmark's result on stdout, and in its --out file when given: one way for all of them."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> int:
    """Print ``result`` as indented JSON and write the same to ``out`` (e.g. docs/<name>.json); 0."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
