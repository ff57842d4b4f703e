"""Typed parsing of a Hugging Face config.json into a frozen dataclass.

Every family declares its config as a dataclass; `parse` checks that each field
is present (unless it has a default) and of the annotated JSON type, that a
number is finite and an integer fits in 64 bits, and that fields naming
architecture features hold a value the family implements. `require_sizes`
bounds the sizes that drive allocations and loops (`dlmrt.core.limits`). Errors
name the file, the field, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError

C = TypeVar("C")

_JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               type(None): "null"}


def matches(value: Any, kind: Any) -> bool:
    """Whether a JSON value has the annotated type (a boolean is not a number; an int is a float)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)  # str


def _describe(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    return _JSON_NAMES[kind]


def _json(value: Any) -> str:
    return json.dumps(value)


def _found(value: Any) -> str:
    return f"{_json(value)} ({type(value).__name__})"


def parse(cls: type[C], raw: Mapping[str, Any], source: Path | str,
          supported: Mapping[str, tuple[Any, ...]] | None = None) -> C:
    """Build `cls` from the JSON object `raw`; unknown keys are ignored, as Hugging Face does.

    `supported` maps a raw key to the values dlmrt implements for it; any other
    value raises UnsupportedFeatureError before a weight is read.
    """
    for key, allowed in (supported or {}).items():
        if key in raw and not any(type(raw[key]) is type(a) and raw[key] == a for a in allowed):
            choices = ", ".join(_json(a) for a in allowed)
            raise UnsupportedFeatureError(
                f"{source}: {key}={_json(raw[key])} is not supported by dlmrt (supported: {choices})")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        kind = hints[field.name]
        if field.name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise CheckpointError(
                    f"{source}: required field '{field.name}' is missing (expected {_describe(kind)})")
            continue
        value = raw[field.name]
        if not matches(value, kind):
            raise CheckpointError(
                f"{source}: field '{field.name}' must be {_describe(kind)}, got {_found(value)}")
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise CheckpointError(f"{source}: field '{field.name}' does not fit in 64 bits, got {_short(value)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and kind is float \
                and not math.isfinite(float(value)):
            raise CheckpointError(f"{source}: field '{field.name}' must be a finite number, got {_short(value)}")
        values[field.name] = float(value) if kind is float else value
    return cls(**values)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def require_sizes(config: Any, source: Path | str, bounds: Mapping[str, int]) -> None:
    """Each named size of `config` (a field or property, None for unset) lies in [1, its bound]."""
    for name, bound in bounds.items():
        value = getattr(config, name)
        if value is not None and not 1 <= value <= bound:
            raise CheckpointError(f"{source}: {name} must lie in [1, {bound}], got {_short(value)}")


def require(condition: bool, source: Path | str, message: str) -> None:
    """Raise a CheckpointError about `source` unless `condition` holds (for cross-field checks)."""
    if not condition:
        raise CheckpointError(f"{source}: {message}")


def require_norm_and_rope(config: Any, source: Path | str) -> None:
    """The RMSNorm epsilon lies in (0, 1) and the rotary base is positive (`rms_norm_eps`, `rope_theta`)."""
    require(0 < config.rms_norm_eps < 1, source, f"rms_norm_eps must lie in (0, 1), got {config.rms_norm_eps}")
    require(config.rope_theta > 0, source, f"rope_theta must be positive, got {config.rope_theta}")


def require_divisible(source: Path | str, name: str, value: int, divisor_name: str, divisor: int) -> None:
    """`value` (the field `name`) is a multiple of `divisor` (the field `divisor_name`)."""
    require(value % divisor == 0, source, f"{name} ({value}) must be divisible by {divisor_name} ({divisor})")
