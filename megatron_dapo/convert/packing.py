"""The one packing rule: consecutive items, greedily grouped by bytes.

Used for output shards (safetensors_io), for export buckets (export.py), for the checkpoint
regions megatron_to_hf reads per step (mcore/mcore_to_hf.py) and for the buckets a weight sync
hands the rollout engine (rollout/weight_sync.py), so that every one of them agrees with the others
on where a group ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def iter_packed(items: Iterable[T], nbytes: Callable[[T], int], limit: int, *,
                same: Callable[[T, T], bool] | None = None) -> Iterator[list[T]]:
    """``items`` in order, in groups, consumed lazily (one group held at a time): a new group starts
    when the next item would take the current one past ``limit`` bytes (an item larger than that gets
    a group of its own) or, with ``same``, when same(first item of the group, item) is False. No
    group is empty; no items, no groups."""
    if limit < 1:
        raise ValueError(f"the byte limit must be >= 1, got {limit}")
    group: list[T] = []
    filled = 0
    for item in items:
        size = nbytes(item)
        if group and (filled + size > limit or (same is not None and not same(group[0], item))):
            yield group
            group, filled = [], 0
        group.append(item)
        filled += size
    if group:
        yield group


def pack_consecutive(items: Sequence[T], nbytes: Callable[[T], int], limit: int, *,
                     same: Callable[[T, T], bool] | None = None) -> list[list[T]]:
    """``iter_packed``'s groups, as a list."""
    return list(iter_packed(items, nbytes, limit, same=same))
