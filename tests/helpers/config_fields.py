"""The leaf settings of a config dataclass, for the tests that check every key is read and acts."""

from __future__ import annotations

import dataclasses


def leaves(cls: type, path: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(dotted key, section attribute or "" at the top, section class name) of every leaf field."""
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out += leaves(f.type, (*path, f.name))
        else:
            out.append((".".join((*path, f.name)), path[-1] if path else "", cls.__name__))
    return out
