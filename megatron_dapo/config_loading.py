"""YAML files with ``defaults:`` inheritance and dotted ``key=value`` overrides -> ``DAPOConfig``.

A YAML file may start with ``defaults: other.yaml`` (or a list), resolved relative to the file and
merged first; the file's own keys win. Command-line overrides (``loss.clip_ratio_high=0.3``) are
parsed as YAML scalars and applied last. Unknown keys, wrong types and inconsistent values raise a
``ConfigError`` naming the key, where it came from and the fix, before any heavy work starts; a key of
verl's names ours (verl_keys.py).

Of Hydra's override syntax, what a fixed schema can mean: ``++key=value`` sets the key (as
``key=value``), ``~key`` drops what the files and earlier overrides set, so the key (or a whole
section) takes its default. ``+key=value`` adds a key the config lacks, and every key here already
exists, so it is refused with the plain spelling; so is ``~key=value`` (delete if equal), with ``~key``.
"""

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_dapo.config import DAPOConfig, field_help
from megatron_dapo.errors import ConfigError
from megatron_dapo.verl_keys import verl_hint


_SECTIONS = frozenset(f.name for f in dataclasses.fields(DAPOConfig))  # our top-level keys

# Keys that moved, with where to: an old config names the new spelling instead of "unknown key".
MOVED = {
    "loss.tis_cap": "truncated importance sampling moved to algorithm.rollout_correction: set "
                    "algorithm.rollout_correction.rollout_is=token and rollout_is_threshold=<the cap> "
                    "(or drop the key: null was off)",
}


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> DAPOConfig:
    """Defaults <- YAML file (with its ``defaults:`` chain) <- ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _load_yaml_chain(Path(path), seen=())
    for item in overrides:
        _apply_override(raw, item)
    for key in _leaf_keys(raw, ""):  # verl's keys first: their error names ours, not a near spelling
        if _schema_error(key) is not None and (hint := verl_hint(key, _SECTIONS)):
            raise ConfigError(hint)
    return build(DAPOConfig, raw, where="")


def override_key(item: str) -> str:
    """The dotted key a command-line override sets or resets (``key=value``, ``++key=value``, ``~key``)."""
    return item.lstrip("+~").partition("=")[0].strip()


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """One command-line override into ``raw``: ``key=value``, or Hydra's ``++key=value`` / ``~key``."""
    if item.startswith("~"):
        return _reset(raw, item)
    text = item[2:] if item.startswith("++") else item
    if text.startswith("+"):
        _refuse_append(item)
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        hint = f"; a config file goes after --config (--config {item})" if item.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override {item!r} is not of the form key.path=value{hint}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote it, "
                          "or write lists as [a, b]") from None
    _set_dotted(raw, key.strip(), parsed)


def _refuse_append(item: str) -> None:
    """Hydra's ``+key=value`` appends a key the config lacks; every key of a fixed schema exists already."""
    key = item[1:].partition("=")[0].strip()
    _require_known(key, item)
    raise ConfigError(f"override {item!r}: Hydra's + adds a key the config lacks, and every key here exists "
                      f"already (unknown keys are errors); write {item[1:]}")


def _reset(raw: dict[str, Any], item: str) -> None:
    """Hydra's ``~key``: forget what the files and earlier overrides set, so the schema's default applies."""
    key, sep, _ = item[1:].partition("=")
    key = key.strip()
    if sep:
        raise ConfigError(f"override {item!r}: Hydra's ~key=value (delete if equal) is not supported; write ~{key}, "
                          "which resets it to its default")
    _require_known(key, item)
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    node.pop(parts[-1], None)


def _require_known(key: str, item: str) -> None:
    if not key:
        raise ConfigError(f"override {item!r} names no key")
    if (error := _schema_error(key)) is not None:
        raise ConfigError(verl_hint(key, _SECTIONS) or error)


def build(cls: type, raw: dict[str, Any], where: str) -> Any:
    """Builds a config dataclass from nested dicts, checking keys and types; ``where`` prefixes errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'} must be a mapping, got {type(raw).__name__}: {raw!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in known]
    for key in unknown:  # also under a prefix (the NeMo-Aligner adapter's model.ppo.loss.)
        moved = [why for old, why in MOVED.items() if f"{where}{key}" == old or f"{where}{key}".endswith("." + old)]
        if moved:
            raise ConfigError(f"{where}{key}={raw[key]!r}: {moved[0]}")
    if unknown:
        raise ConfigError(_unknown_key(where, unknown[0], list(known)))
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}{name}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _unknown_key(where: str, key: Any, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=3)
    hint = f"; did you mean {', '.join(where + c for c in close)}?" if close else ""
    return f"unknown config key {where}{key}{hint} (valid keys here: {', '.join(known)})"


def _schema_error(key: str) -> str | None:
    """None when the dotted ``key`` names a setting or a section of the schema, else why not."""
    cls, where = DAPOConfig, ""
    for part in key.split("."):
        if cls is None:
            return f"{where.rstrip('.')} is a value, not a section"
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return _unknown_key(where, part, [f.name for f in dataclasses.fields(cls)])
        cls = hints[part] if dataclasses.is_dataclass(hints[part]) else None
        where += part + "."
    return None


def _leaf_keys(raw: dict[str, Any], prefix: str) -> typing.Iterator[str]:
    """The dotted keys of the values in nested ``raw`` (an empty mapping counts as a value)."""
    for k, v in raw.items():
        if isinstance(v, dict) and v:
            yield from _leaf_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples as lists) of a config, ready for YAML/JSON."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else (list(v) if isinstance(v, tuple) else v)
    return out


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def defaults_yaml() -> str:
    """``conf/base.yaml``: every key with its default and a one-line comment, from the schema."""
    lines = ["# Every setting with its default, generated from megatron_dapo/config.py (the one home of",
             "# defaults): `megatron-dapo config --defaults > conf/base.yaml`. Edit config.py, not this file.",
             ""]
    _emit(DAPOConfig(), 0, lines)
    return "\n".join(lines) + "\n"


def _emit(cfg: Any, indent: int, lines: list[str]) -> None:
    helps = field_help(type(cfg))
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            lines.append(f"{pad}{f.name}:  # {helps[f.name]}")
            _emit(v, indent + 1, lines)
        else:
            value = yaml.safe_dump(list(v) if isinstance(v, tuple) else v, default_flow_style=True).strip()
            value = value.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {value}  # {helps[f.name]}")


def _yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line message as one line: the problem and where (1-based line, column)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def _load_yaml_chain(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"defaults cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse {path}: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    parents = data.pop("defaults", [])
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        _deep_merge(merged, _load_yaml_chain(path.parent / parent, (*seen, path)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> None:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Checks ``value`` against the annotation ``tp``; converts lists to tuples and ints to floats."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, where=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors, named = [], []  # named: the literal values an alternative after the first allows
        for i, arg in enumerate(a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
            if i and typing.get_origin(arg) is typing.Literal:
                named += typing.get_args(arg)
        raise ConfigError(errors[0] + (f", or one of {named}" if named else ""))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]  # a single file name is a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"config field {key} has an unsupported annotation {tp}")
