"""The machinery every config section uses: documented fields, range checks, and reading a
section from YAML with the errors a user can act on.

A section is a dataclass whose fields are made with :func:`setting` (``help`` and optional
``ge``/``gt``/``le``/``lt`` bounds in the field metadata). It lives next to the code that reads
it (``actor/settings.py``, ``rollout/settings.py``, ...) and checks its own fields in a
``validate()`` that calls :func:`check_ranges`; ``megatron_m2po/config.py`` composes the sections
into one tree and keeps only the rules that span sections. This module imports nothing from the
package, so that every layer may import a settings module (torchtitan keeps each component's
``Config`` next to the component the same way: ``torchtitan/config/job_config.py``).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Pool:
    ...     workers: int = setting(2, ge=1, help="Worker processes.")
    >>> settings_from_dict(Pool, {"workers": 3}, "pool")
    Pool(workers=3)
    >>> try:
    ...     settings_from_dict(Pool, {"workers": 0}, "pool")
    ... except ConfigError as e:
    ...     print(e)
    pool.workers=0 is out of range: must be >= 1 (Worker processes.)
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import field
from typing import Any, Callable, Iterable, Literal, Union

__all__ = ["ConfigError", "setting", "check_ranges", "coerce", "is_optional", "unknown_key", "section_from_dict",
           "settings_from_dict"]


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of its allowed range."""


def setting(default: Any = dataclasses.MISSING, *, help: str, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None,
            factory: Any = None) -> Any:
    """A dataclass field with documentation and an optional numeric range."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def is_optional(tp: Any) -> tuple[bool, Any]:
    """(whether ``tp`` is ``Optional[X]``, ``X``); ``(False, tp)`` for any other type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {tp} at {key}")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, or raise naming the key."""
    optional, inner = is_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {_type_name(tp)})")
    tp = inner
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping (key: value)")
        return dict(value)
    if origin in (list, tuple):
        (elem,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):  # "a,b" from the command line
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    return _coerce_scalar(value, tp, key)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def check_ranges(section: Any, prefix: str) -> None:
    """Every numeric field of ``section`` (and of the sections nested in it) within the bounds its
    metadata declares; ConfigError naming the dotted key, the value, the bound and the field's help."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(v):
            check_ranges(v, key)
            continue
        if v is None or isinstance(v, (bool, str, list, dict)):
            continue
        m = f.metadata
        bounds = [("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                  ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")]
        for name, ok, sym in bounds:
            b = m.get(name)
            if b is not None and not ok(v, b):
                raise ConfigError(f"{key}={v!r} is out of range: must be {sym} {b} ({m.get('help', '')})")


def unknown_key(key: str, names: Iterable[str], full: str | None = None,
                moved: dict[str, str] | None = None) -> str:
    """The error text for an unknown dotted ``key`` among the field ``names`` of its section, with a
    did-you-mean (``full``: the whole override key; ``moved``: old dotted key -> new, so that an old
    leaf name close to the typo points at where it went)."""
    full = full or key
    prefix, _, leaf = key.rpartition(".")
    renamed = {k.rpartition(".")[2]: v for k, v in (moved or {}).items() if k.rpartition(".")[0] == prefix}
    near = difflib.get_close_matches(leaf, list(names) + list(renamed), n=1)
    if near:
        hint = f"; did you mean {renamed.get(near[0]) or '.'.join(filter(None, [prefix, near[0]]))}?"
    else:
        hint = f"; keys under {prefix or '<top>'}: {sorted(names)}"
    return f"unknown config key {full}{hint}"


UnknownKey = Callable[[str, Iterable[str]], str]


def section_from_dict(cls: type, data: dict, prefix: str, unknown: UnknownKey = unknown_key) -> Any:
    """A section dataclass (and the sections nested in it) from a mapping, each value coerced to its
    annotated type; ``unknown(dotted_key, field_names)`` words the error for a key the section lacks."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(unknown(key, names))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = section_from_dict(tp, v or {}, key, unknown)
        else:
            kwargs[k] = coerce(v, tp, key)
    return cls(**kwargs)


def settings_from_dict(cls: type, data: dict, prefix: str) -> Any:
    """A settings dataclass (e.g. a plugin loss's) from a mapping, with the checks of the config tree:
    unknown keys (did-you-mean), types, ``ge``/``gt``/``le``/``lt`` metadata and ``check()``."""
    obj = section_from_dict(cls, data or {}, prefix)
    check_ranges(obj, prefix)
    try:
        if hasattr(obj, "check"):
            obj.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return obj
