"""A bounded history of departed keys, oldest first, that the garbage collector does not track.

The policies remember pages that left (ghosts: ARC's B1/B2, S3-FIFO's G, the use counts of
LFU and kvaware) for a few times the tier's capacity: with 10,000 idle sequences that is
~120,000 keys. An ``OrderedDict`` is always tracked, so every full collector pass walked all of
them. :class:`History` keeps the same order and operations in two plain dicts of atomic
objects, which CPython does not track while their keys are (bytes and int page keys are)::

    value: key   -> stamp << 4 | count     (count: 0..15, a use count or 0)
    order: stamp -> key                    stamps rise by one per put; oldest <= every live one

``put`` gives a key the next stamp (to the newest end, as ``OrderedDict.move_to_end``); the
oldest key is the one with the lowest live stamp, found by stepping ``oldest`` over stamps
whose key has moved on or left (each stamp is stepped over once: O(1) amortized).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

from tierkv.policies.base import Key

COUNT_BITS = 4
"""The low bits of a value that hold the key's count (counts are 0..15)."""

_COUNT = (1 << COUNT_BITS) - 1


def _native() -> ModuleType | None:
    """The C twins of :meth:`History.trim` and :meth:`History.put_many` (``_kvaware.c``), or
    None where the extension was not built or ``TIERKV_NATIVE_POLICY=0``."""
    if os.environ.get("TIERKV_NATIVE_POLICY", "1") == "0":
        return None
    try:
        module = importlib.import_module(f"{__package__}._kvaware")
    except ImportError:
        return None
    return module if getattr(module, "ABI", None) == 1 else None  # (kvaware_loops.ABI)


_C = _native()
_TRIM: Callable[[History, float], None] | None = getattr(_C, "history_trim", None)
_PUT_MANY: Callable[[History, Iterable[Key], int], None] | None = getattr(
    _C, "history_put_many", None
)


class History:
    """Keys with a small count each (0..15), in the order they were last put.

    Attributes:
        value: key -> ``stamp << COUNT_BITS | count``; read it (``key in value``) in hot
            loops, change it only through the methods.
        order: stamp -> key, one entry per key of ``value``.
        stamp: the next stamp :meth:`put` gives.
        oldest: no key has a stamp below it.
    """

    __slots__ = ("oldest", "order", "stamp", "value")

    def __init__(self) -> None:
        self.value: dict[Key, int] = {}
        self.order: dict[int, Key] = {}
        self.stamp = 0
        self.oldest = 0

    def __len__(self) -> int:
        return len(self.value)

    def __contains__(self, key: object) -> bool:
        return key in self.value

    def __iter__(self) -> Iterator[Key]:
        """The keys, oldest first."""
        order = self.order
        return iter([order[t] for t in sorted(order)])

    def get(self, key: Key, default: int = 0) -> int:
        """The count of ``key``, or ``default`` when it is not remembered."""
        v = self.value.get(key)
        return default if v is None else v & _COUNT

    def put(self, key: Key, count: int) -> None:
        """Remember ``key`` with ``count`` (0..15) as the newest key (moved there if held)."""
        value, order = self.value, self.order
        old = value.get(key)
        if old is not None:
            del order[old >> COUNT_BITS]
        t = self.stamp
        self.stamp = t + 1
        value[key] = (t << COUNT_BITS) | count
        order[t] = key

    def put_many(self, keys: Iterable[Key], count: int) -> None:
        """:meth:`put` each of ``keys``, in order, with the same ``count``."""
        if _PUT_MANY is not None:  # the same steps in C
            _PUT_MANY(self, keys, count)
            return
        value, order = self.value, self.order
        get = value.get
        t = self.stamp
        for key in keys:
            old = get(key)
            if old is not None:
                del order[old >> COUNT_BITS]
            value[key] = (t << COUNT_BITS) | count
            order[t] = key
            t += 1
        self.stamp = t

    def touch(self, key: Key) -> None:
        """Make a held ``key`` the newest, its count unchanged (``move_to_end``)."""
        self.put(key, self.value[key] & _COUNT)

    def pop(self, key: Key, default: int = 0) -> int:
        """Forget ``key``; its count, or ``default`` when it was not remembered."""
        v = self.value.pop(key, None)
        if v is None:
            return default
        del self.order[v >> COUNT_BITS]
        return v & _COUNT

    def pop_oldest(self) -> Key:
        """Forget the oldest key and return it. Raises KeyError when empty."""
        value, order = self.value, self.order
        if not value:
            raise KeyError("pop_oldest(): the history is empty")
        t = self.oldest
        while t not in order:
            t += 1
        key = order.pop(t)
        del value[key]
        self.oldest = t + 1
        return key

    def trim(self, limit: float) -> None:
        """Forget the oldest keys until at most ``limit`` are left (none for a negative one)."""
        value, order = self.value, self.order
        if len(value) <= limit:
            return
        if _TRIM is not None:  # the same steps in C
            _TRIM(self, limit)
            return
        limit = max(limit, 0)
        t = self.oldest
        while len(value) > limit:
            while t not in order:
                t += 1
            del value[order.pop(t)]
            t += 1
        self.oldest = t

    def clear(self) -> None:
        """Forget every key."""
        self.value.clear()
        self.order.clear()
        self.oldest = self.stamp
