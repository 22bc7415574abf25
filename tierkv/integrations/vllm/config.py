"""Checking a vLLM tier config: unknown or wrong-typed fields are a typed error at startup."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.errors import InvalidInputError, InvalidTypeError

__all__ = ["Field", "VllmTierConfigError", "VllmTierTypeError", "check_options"]


class VllmTierConfigError(InvalidInputError):
    """A tierkv tier config for vLLM names an unknown field, lacks a required one, or holds
    a value out of range."""


class VllmTierTypeError(VllmTierConfigError, InvalidTypeError):
    """A field of a tierkv tier config for vLLM has the wrong type."""


_MISSING: Any = object()


@dataclass(frozen=True)
class Field:
    """One config field: the accepted types, the default (none: required), the bounds."""

    types: tuple[type, ...]
    default: Any = _MISSING
    minimum: float | None = None
    maximum: float | None = None

    @property
    def required(self) -> bool:
        """Whether the config must give it."""
        return self.default is _MISSING


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if value is None:
        return type(None) in types
    if isinstance(value, bool):  # bool is an int: only where bool itself is named
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def check_options(
    tier: str, options: Mapping[str, Any], fields: Mapping[str, Field]
) -> dict[str, Any]:
    """The options with defaults filled in; raises VllmTierConfigError (unknown, missing, out of
    range) or VllmTierTypeError naming the tier and the field."""
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise VllmTierConfigError(
            f"{tier}: unknown config field(s) {unknown}; accepted: {sorted(fields)}"
        )
    out: dict[str, Any] = {}
    for name, spec in fields.items():
        if name not in options:
            if spec.required:
                raise VllmTierConfigError(f"{tier}: config field {name!r} is required")
            out[name] = spec.default
            continue
        value = options[name]
        if not _type_ok(value, spec.types):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in spec.types)
            raise VllmTierTypeError(
                f"{tier}: config field {name!r} must be {want}, got {type(value).__name__} "
                f"{value!r}"
            )
        if isinstance(value, float) and not math.isfinite(value):  # (NaN passed any minimum)
            raise VllmTierConfigError(
                f"{tier}: config field {name!r} must be a finite number, got {value!r}"
            )
        if spec.minimum is not None and value is not None and value < spec.minimum:
            raise VllmTierConfigError(
                f"{tier}: config field {name!r} must be >= {spec.minimum}, got {value!r}"
            )
        if spec.maximum is not None and value is not None and value > spec.maximum:
            raise VllmTierConfigError(  # (a 1e300 s timeout was an OverflowError at startup)
                f"{tier}: config field {name!r} must be <= {spec.maximum:g}, got {value!r}"
            )
        out[name] = value
    return out
