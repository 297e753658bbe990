"""The one packing rule of the converter: consecutive items, greedily grouped by bytes.

Used for output shards (safetensors_io), for export buckets (export.py) and for the checkpoint
regions megatron_to_hf reads per step (policy/hf_conversion.py), so that every one of them agrees
with the others on where a group ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def pack_consecutive(items: Sequence[T], nbytes: Callable[[T], int], limit: int, *,
                     same: Callable[[T, T], bool] | None = None) -> list[list[T]]:
    """``items`` in order, in groups: a new group starts when the next item would take the current
    one past ``limit`` bytes (an item larger than that gets a group of its own) or, with ``same``,
    when same(first item of the group, item) is False. No group is empty; no items, no groups."""
    groups: list[list[T]] = []
    filled = 0
    for item in items:
        size = nbytes(item)
        if not groups or filled + size > limit or (same is not None and not same(groups[-1][0], item)):
            groups.append([])
            filled = 0
        groups[-1].append(item)
        filled += size
    return groups
