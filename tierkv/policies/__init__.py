"""Eviction policies behind one interface, and a registry by name."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.policies.arc import ARCPolicy
from tierkv.policies.base import NO_HINT, CanEvict, EvictionPolicy, Key, PageHint
from tierkv.policies.kvaware import KVAwarePolicy
from tierkv.policies.lfu import LFUPolicy
from tierkv.policies.lru import LRUPolicy
from tierkv.policies.s3fifo import S3FIFOPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "kvaware": KVAwarePolicy,
}

DEFAULT_POLICY = "kvaware"
"""The policy a tier uses unless told otherwise (see ``docs/policies.md`` for why)."""


def make_policy(name: str) -> EvictionPolicy:
    """A new policy instance by name (see :data:`POLICIES`).

    Raises:
        ValueError: the name is unknown.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None


__all__ = [
    "DEFAULT_POLICY",
    "NO_HINT",
    "POLICIES",
    "ARCPolicy",
    "CanEvict",
    "EvictionPolicy",
    "KVAwarePolicy",
    "Key",
    "LFUPolicy",
    "LRUPolicy",
    "PageHint",
    "S3FIFOPolicy",
    "make_policy",
]
