"""The store's error boundary: runtime and transport errors leave it as tierkv errors.

The public methods of :class:`~tierkv.store.KVStore`, :class:`~tierkv.lease.Lease` and
:class:`~tierkv.sync.SyncKVStore` are wrapped with :func:`boundary` (plain methods) or
:func:`async_boundary` (coroutines). A tierkv error passes unchanged; a lower one is mapped by
:func:`map_error` and raised ``from`` the original (the mapping is drawn in
:mod:`tierkv.errors`). Errors the table does not name (a bug's AttributeError, say) pass as they
are: mapping them would hide the bug. Cancellation is never touched.

Transport errors (from a remote tier) are mapped by the mapper the remote package registers
(:func:`register_transport_mapper`, called by :mod:`tierkv.remote.errors` when it is imported):
this module never imports the remote package, which imports the store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import tierkv.transports as transports
from tierkv.arguments import unfit
from tierkv.errors import (
    AllocationError,
    EngineError,
    StoreClosedError,
    StoreTimeoutError,
    TierKVError,
    TransferFailedError,
)
from tierkv.runtime import (
    ArenaError,
    EngineClosedError,
    RuntimeEngineError,
    TransferError,
    WaitTimeoutError,
)

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["async_boundary", "boundary", "map_error", "register_transport_mapper"]

TransportMapper = Callable[[transports.TransportError], TierKVError]
_transport_mapper: list[TransportMapper] = []


def register_transport_mapper(mapper: TransportMapper) -> None:
    """Map transport errors at the boundary with ``mapper`` (the remote package's
    ``map_transport_error``; the last one registered wins)."""
    _transport_mapper[:] = [mapper]


def map_error(exc: BaseException) -> TierKVError | None:
    """The tierkv error that stands for ``exc`` at the store's boundary, or None when ``exc``
    is already one of the semantic layer's errors or is not one the boundary maps. (The
    runtime's and transports' trees hang under TierKVError too, but the store speaks in its
    own terms: they are mapped all the same.)"""
    if not isinstance(exc, Exception):
        return None
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, RuntimeEngineError):
        if isinstance(exc, WaitTimeoutError):
            return StoreTimeoutError(msg)
        if isinstance(exc, TransferError):
            return TransferFailedError(msg)
        if isinstance(exc, EngineClosedError):
            return StoreClosedError(f"the store's transfer engine is closed: {msg}")
        if isinstance(exc, ArenaError):
            return AllocationError(msg)
        return EngineError(msg)
    if isinstance(exc, transports.TransportError):
        if _transport_mapper:
            return _transport_mapper[0](exc)
        return TransferFailedError(f"the remote tier: {type(exc).__name__}: {msg}")
    if isinstance(exc, TierKVError):
        return None
    if isinstance(exc, TimeoutError):
        return StoreTimeoutError(msg)
    return None


def boundary(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap a public method: lower errors it raises leave it mapped (:func:`map_error`)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except TypeError as exc:  # arguments that do not fit: typed (tierkv.arguments)
            bad = unfit(fn, args, kwargs, exc)
            if bad is None:
                raise
            raise bad from None
        except Exception as exc:
            mapped = map_error(exc)
            if mapped is None:
                raise
            raise mapped from exc

    return wrapper


def async_boundary(
    fn: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R]]:
    """Wrap a public coroutine method: lower errors leave it mapped (:func:`map_error`)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except TypeError as exc:
            bad = unfit(fn, args, kwargs, exc)
            if bad is None:
                raise
            raise bad from None
        except Exception as exc:
            mapped = map_error(exc)
            if mapped is None:
                raise
            raise mapped from exc

    return wrapper
