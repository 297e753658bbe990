"""The building blocks of the config schema's sections (config.py, config_algo.py): a field with its
help text, a nested section, and the one-line refusals every section's own rules raise."""

from dataclasses import field, fields
from typing import Any, Callable

from megatron_dapo.errors import ConfigError


def setting(default: Any, help: str) -> Any:
    """A dataclass field with its help text (tuples are immutable, so plain defaults suffice)."""
    return field(default=default, metadata={"help": help})


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


def fail(msg: str) -> None:
    raise ConfigError(msg)


def require(section: str, obj: Any, **rules: tuple[Callable[[Any], bool], str]) -> None:
    """Each field in ``rules`` (name -> (predicate, the rule in words)): the first broken fails naming it."""
    for name, (ok, rule) in rules.items():
        value = getattr(obj, name)
        if not ok(value):
            fail(f"{section + '.' if section else ''}{name} must be {rule}, got {value}")


def at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f">= {low}"


def above(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > low), f"> {low}"


def field_help(cls: type) -> dict[str, str]:
    """{field name: help text} of a config section."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
