"""kvaware's parent -> children map: each parent key maps to its one resident child, or to a
set of them (most pages have one child: no set to make and drop per page); a set stays a set
until it is empty. The policy and its Python loops change the map through these three only
(``_kvaware.c`` keeps the same map with the same rules)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tierkv.policies.base import Key

__all__ = ["Kids", "add_child", "children", "drop_child"]

Kids = dict[Key, Any]  # parent -> Key | set[Key]

_NONE = object()


def add_child(kids: Kids, parent: Key, key: Key) -> None:
    """Record ``key`` as a resident child of ``parent``."""
    sibs = kids.get(parent, _NONE)
    if sibs is _NONE:
        kids[parent] = key
    elif isinstance(sibs, set):
        sibs.add(key)
    else:
        kids[parent] = {sibs, key}


def drop_child(kids: Kids, parent: Key, key: Key) -> None:
    """Forget ``key`` as a child of ``parent`` (the parent's entry goes with its last child)."""
    sibs = kids.get(parent, _NONE)
    if isinstance(sibs, set):
        sibs.discard(key)
        if not sibs:
            del kids[parent]
    elif sibs is not _NONE and sibs == key:
        del kids[parent]


def children(mine: Any) -> Iterable[Key]:
    """The children in one entry of the map (a key or a set of keys)."""
    return mine if isinstance(mine, set) else (mine,)
