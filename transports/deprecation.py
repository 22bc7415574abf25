"""Deprecated aliases: an old public name that still works, with a `DeprecationWarning`.

When a public function is renamed (one verb per idea across the code base: ``create_*`` for every
registry, pin/unpin), its old name stays importable as a thin alias made here, so callers
keep working and are told the new name::

    make_policy = deprecated_alias(create_policy, "make_policy")
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["deprecated_alias", "warn_renamed"]

P = ParamSpec("P")
R = TypeVar("R")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (`DeprecationWarning`) that ``old`` is an alias of ``new`` now."""
    warnings.warn(
        f"{old} is deprecated; use {new} (same arguments, same result)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def deprecated_alias(new: Callable[P, R], old: str) -> Callable[P, R]:
    """``new`` under its former name ``old``: each call warns, then calls ``new``."""

    @functools.wraps(new)
    def alias(*args: P.args, **kwargs: P.kwargs) -> R:
        warn_renamed(old, new.__name__)
        return new(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated alias of :func:`{new.__name__}` (warns on each call)."
    return alias
