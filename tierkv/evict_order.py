"""Where each page of a tier stands in an announced order (:mod:`tierkv.page_table`): the
victims of a schedule found in a few numpy operations over the tier's slots, not by walking
the order.

A server announces the pages its coming steps read, soonest needed first, and evictions take
the evictable ones read last (:meth:`tierkv.page_table.PageTable.prepare_evict`'s
``keep_order``). Most of an order's tail is often not resident (a step streams its later
layers through the device): a walk from the end of the order passes over every one of them,
once per eviction, and a step at batch 32 (62,400 pages announced) spent most of its store
time so. Here each slot holds its page's position in the order (-1: not in it, or free), kept
as pages come and go, and the latest evictable pages are one masked ``argpartition``.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import repeat

import numpy as np
import numpy.typing as npt

from tierkv.policies import Key

__all__ = ["SMALL", "OrderIndex"]

#: Slots up to which :meth:`OrderIndex.latest` and ``held`` take one Python pass: numpy's
#: fixed cost per operation is the larger there, and inside a model's forward (caches full of
#: the model's data) it grows several-fold: ``latest`` took 80 us a call in tierkv demo's
#: SmolLM2 decode (67 device slots), ``held`` 39 us.
SMALL = 256
_FEW = 16  # slots placed or freed at once up to which a Python loop sets them


class OrderIndex:
    """The positions in ``order`` of the pages of a tier of ``capacity`` slots whose used
    slots are ``key_of`` (slot -> key) now. Its owner (the page table) reports every page that
    takes a slot (:meth:`placed`, a rename too) and every slot that goes free (:meth:`freed`).
    """

    __slots__ = ("_index", "order", "pos")

    def __init__(self, order: Sequence[Key], capacity: int, key_of: Mapping[int, Key]) -> None:
        self.order = order  # (compared by identity: a new announcement builds a new index)
        self._index = dict(zip(order, range(len(order))))  # a key named twice: its last place
        self.pos: npt.NDArray[np.int64] = np.full(capacity, -1, dtype=np.int64)
        if key_of:
            self.placed(list(key_of), list(key_of.values()))

    def placed(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Pages ``keys`` now hold ``slots`` (aligned)."""
        if len(slots) <= _FEW:  # (numpy's fancy indexing costs more for a few)
            pos, get = self.pos, self._index.get
            for s, k in zip(slots, keys):
                pos[s] = get(k, -1)
        else:
            get = self._index.get
            self.pos[list(slots)] = np.fromiter(map(get, keys, repeat(-1)), np.int64, len(keys))

    def freed(self, slots: Sequence[int]) -> None:
        """``slots`` hold no page any more."""
        if len(slots) <= _FEW:
            pos = self.pos
            for s in slots:
                pos[s] = -1
        else:
            self.pos[list(slots)] = -1

    def latest(self, n: int, state: bytearray, pins: array[int], readable: int) -> list[int]:
        """Up to ``n`` slots of pages in the order, readable (``state[s] == readable``) and
        unpinned, those latest in the order first."""
        if len(self.pos) <= SMALL:
            return self.latest_py(n, state, pins, readable)
        return self.latest_np(n, state, pins, readable)

    def latest_py(self, n: int, state: bytearray, pins: array[int], readable: int) -> list[int]:
        """:meth:`latest` in one Python pass (a tier of a few hundred slots)."""
        got = [
            (p, s)
            for s, p in enumerate(self.pos.tolist())
            if p >= 0 and state[s] == readable and not pins[s]
        ]
        got.sort(reverse=True)  # (places are distinct: a page holds one slot)
        return [s for _, s in got[:n]]

    def latest_np(self, n: int, state: bytearray, pins: array[int], readable: int) -> list[int]:
        """:meth:`latest` in a few numpy operations (a large tier)."""
        pos = self.pos
        ok = pos >= 0
        ok &= np.frombuffer(state, dtype=np.uint8) == readable
        ok &= np.frombuffer(pins, dtype=f"i{pins.itemsize}") == 0
        idx = np.flatnonzero(ok)
        if len(idx) > n:
            idx = idx[np.argpartition(pos[idx], len(idx) - n)[len(idx) - n :]]
        out: list[int] = idx[np.argsort(-pos[idx])].tolist()
        return out

    def latest_of_all(
        self, n: int, state: bytearray, pins: array[int], readable: int, used: int
    ) -> list[int] | None:
        """:meth:`latest` where every one of the tier's ``used`` pages is in the order (then
        an eviction that keeps the order's pages takes them by the order alone), else None:
        :meth:`held` and :meth:`latest` in one pass."""
        if len(self.pos) > SMALL:
            return self.latest_np(n, state, pins, readable) if self.held() == used else None
        held = 0
        got = []
        for s, p in enumerate(self.pos.tolist()):
            if p >= 0:
                held += 1
                if state[s] == readable and not pins[s]:
                    got.append((p, s))
        if held != used:
            return None
        got.sort(reverse=True)
        return [s for _, s in got[:n]]

    def held(self) -> int:
        """How many of the tier's pages are in the order."""
        if len(self.pos) <= SMALL:
            return sum(p >= 0 for p in self.pos.tolist())
        return int(np.count_nonzero(self.pos >= 0))

    def check(self, key_of: Mapping[int, Key]) -> None:
        """Assert that every slot holds its page's position (-1 for a free slot or a page not
        in the order). Raises AssertionError."""
        want = np.full(len(self.pos), -1, dtype=np.int64)
        for s, k in key_of.items():
            want[s] = self._index.get(k, -1)
        assert np.array_equal(want, self.pos), "a slot's place in the announced order is stale"
