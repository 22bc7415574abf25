"""Plug-in tiers of the chain: the registry of the tier kinds that are not built in.

A tier that is not built in joins ``KVStore(tiers=[...])`` by :func:`register_tier` with its
entry class (a frozen dataclass whose fields are its options, checked at construction like
the built-in entries'), which implements `PluginEntry`: ``check(spec)`` (its budget against
the page size: typed errors, nothing allocated), ``open(spec)`` (its medium, at the store's
open: a `tierkv.tier.Tier`) and ``register_moves(moves)`` (its host <-> medium moves in the
core's `Moves`). It is then a kind of :mod:`tierkv.chain_config` like the built-in ones, dicts
included, and sits below the host among the lower tiers (with ``disk``, in the order listed,
before ``remote``). The core needs nothing else: the store opens it
(`tierkv.chain.open_lower`) and the lower chain moves pages to and from it by its moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import is_dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from tierkv.errors import TierConfigError, TierKVError, TierTypeError
from tierkv.spec import KVSpec
from tierkv.tier import Moves, Tier
from tierkv.tier_names import COLD, DEVICE, DISK, HOST, REMOTE

__all__ = ["PLUGINS", "PluginEntry", "plugin_call", "register_tier", "unregister_tier"]

_T = TypeVar("_T")

#: The registered plug-in kinds: kind -> entry class.
PLUGINS: dict[str, type[Any]] = {}
_BUILT_IN = (DEVICE, HOST, COLD, DISK, REMOTE)


@runtime_checkable
class PluginEntry(Protocol):
    """The chain entry of a plug-in tier (:func:`register_tier`): a frozen dataclass whose
    fields are the tier's options, ``kind`` its name in ``tiers=`` and its medium's."""

    kind: ClassVar[str]

    def check(self, spec: KVSpec) -> None:
        """Check the entry against the store's pages (a budget under one page...): raise a
        TierConfigError subclass; allocate nothing."""
        ...

    def open(self, spec: KVSpec) -> Tier:
        """Open the tier's medium for a store of ``spec`` (at the store's open; raise a typed
        error with nothing left behind)."""
        ...

    def register_moves(self, moves: Moves) -> None:
        """Register the moves host -> medium and medium -> host in ``moves``."""
        ...


def register_tier(entry: type[Any]) -> None:
    """Make ``entry`` (a `PluginEntry` dataclass) a kind of the chain, by its ``kind``.

    Raises:
        TierTypeError: no ``kind`` (a non-empty str), not a dataclass, or no ``check``,
            ``open`` or ``register_moves``.
        TierConfigError: the kind is taken (a built-in one, or registered already).
    """
    kind = getattr(entry, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TierTypeError(f"a tier entry needs a kind (a non-empty str), got {kind!r}")
    methods = ("check", "open", "register_moves")
    if not isinstance(entry, type) or not is_dataclass(entry):
        raise TierTypeError(f"tier entry {entry!r}: not a dataclass")
    missing = [m for m in methods if not callable(getattr(entry, m, None))]
    if missing:
        raise TierTypeError(f"tier entry {entry.__name__}: no {', '.join(missing)}")
    if kind in _BUILT_IN or kind in PLUGINS:
        raise TierConfigError(f"a tier kind {kind!r} is registered already")
    PLUGINS[kind] = entry


def unregister_tier(kind: str) -> None:
    """Forget a plug-in kind (no error when unknown)."""
    PLUGINS.pop(kind, None)


def plugin_call(kind: str, hook: str, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, a hook of the plug-in tier ``kind`` (``check``, ``open``,
    ``register_moves``): its tierkv errors leave as they are; anything else (a plug-in's bug,
    an OSError of its medium) is a TierConfigError naming the kind and the hook, the original
    kept as ``__cause__``, so that a store never raises an untyped error for a plug-in."""
    try:
        return fn(*args)
    except TierKVError:
        raise
    except Exception as exc:
        raise TierConfigError(
            f"plug-in tier {kind!r}: {hook} failed: {type(exc).__name__}: {exc}"
        ) from exc
