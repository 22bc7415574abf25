"""Eviction policies behind one interface, and a registry by name."""

from __future__ import annotations

from tierkv.errors import SpecError, UnknownPolicyError
from tierkv.policies.arc import ARCPolicy
from tierkv.policies.base import (
    NO_HINT,
    CanEvictSlot,
    ChainHint,
    ChainPart,
    EvictionPolicy,
    Key,
    PageHint,
)
from tierkv.policies.kvaware import KVAwarePolicy
from tierkv.policies.lfu import LFUPolicy
from tierkv.policies.lru import LRUPolicy
from tierkv.policies.s3fifo import S3FIFOPolicy
from tierkv.transports.deprecation import deprecated_alias
from tierkv.transports.named import Registry

POLICIES: Registry[EvictionPolicy] = Registry(
    "eviction policy",
    error=UnknownPolicyError,
    misuse=SpecError,
    builtins={
        "lru": LRUPolicy,
        "lfu": LFUPolicy,
        "arc": ARCPolicy,
        "s3fifo": S3FIFOPolicy,
        "kvaware": KVAwarePolicy,
    },
    result=EvictionPolicy,
)
"""Policy factories by name; ``POLICIES.register(name, factory)`` adds one (a callable taking no
arguments that returns an :class:`EvictionPolicy`)."""

DEFAULT_POLICY = "kvaware"
"""The policy a tier uses unless told otherwise (see ``docs/policies.md`` for why)."""


def create_policy(name: str) -> EvictionPolicy:
    """A new policy instance by name (see :data:`POLICIES`).

    Raises:
        UnknownPolicyError: the name is unknown (an UnknownNameError and a ValueError).
    """
    return POLICIES.create(name)


make_policy = deprecated_alias(create_policy, "make_policy")


__all__ = [
    "DEFAULT_POLICY",
    "NO_HINT",
    "POLICIES",
    "ARCPolicy",
    "CanEvictSlot",
    "ChainHint",
    "ChainPart",
    "EvictionPolicy",
    "KVAwarePolicy",
    "Key",
    "LFUPolicy",
    "LRUPolicy",
    "PageHint",
    "S3FIFOPolicy",
    "create_policy",
    "make_policy",
]
