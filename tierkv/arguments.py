"""Calls whose arguments do not fit the signature (a misspelt keyword, one too many, a required
one missing) raise :class:`~tierkv.errors.InvalidTypeError` (a ``TypeError`` and a
``TierKVError``) naming the callable, not Python's bare ``TypeError``: every public method
wrapped by :mod:`tierkv.boundary`, and the public constructors under :func:`checked_init`::

    KVStore(spec, device_bytes=..., host_byte=...)   # InvalidTypeError: KVStore: unexpected
                                                     # keyword argument 'host_byte' (it takes...

Only the failure path pays: the signature is bound once a call raised ``TypeError``, and a
``TypeError`` from inside the callable (arguments that fit) is left as it is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tierkv.errors import InvalidTypeError, TierKVError

__all__ = ["checked_init", "unfit"]

_C = TypeVar("_C", bound=type)


def unfit(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], exc: TypeError
) -> InvalidTypeError | None:
    """The typed error for a call of ``fn`` that raised ``exc`` because its arguments do not
    fit ``fn``'s signature; None when they fit (``exc`` came from inside) or ``exc`` is a
    tierkv error already."""
    if isinstance(exc, TierKVError):
        return None
    try:
        sig = inspect.signature(fn)
    except ValueError:  # (no signature to bind to: a builtin)
        return None
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "call")).removesuffix(".__init__")
    params = sig.parameters
    if all(p.kind is not p.VAR_KEYWORD for p in params.values()):
        named = [
            n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        unknown = [k for k in kwargs if k not in named]
        if unknown:  # (first: a misspelt keyword also leaves a required one missing)
            known = ", ".join(n for n in named if n != "self")
            what = ", ".join(map(repr, unknown))
            return InvalidTypeError(
                f"{name}: unexpected keyword argument {what} (it takes {known})"
            )
    try:
        sig.bind(*args, **kwargs)
    except TypeError as bad:
        return InvalidTypeError(f"{name}: {bad}")
    return None


def checked_init(cls: _C) -> _C:
    """Class decorator: a construction whose arguments do not fit ``cls.__init__`` raises
    InvalidTypeError (apply it above ``@dataclass``)."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError as exc:
            bad = unfit(init, (self, *args), kwargs, exc)
            if bad is None:
                raise
            raise bad from None

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
