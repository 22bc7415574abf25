"""Eviction policies behind one interface, and a registry by name."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint
from tierkv.policies.lru import LRUPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}

DEFAULT_POLICY = "lru"


def make_policy(name: str) -> EvictionPolicy:
    """A new policy instance by name (see :data:`POLICIES`).

    Raises:
        ValueError: the name is unknown.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None


__all__ = [
    "DEFAULT_POLICY",
    "NO_HINT",
    "POLICIES",
    "CanEvict",
    "EvictionPolicy",
    "Key",
    "LRUPolicy",
    "PageHint",
    "make_policy",
]
