"""The in-memory index of the disk medium: key -> slot, the free list, reservations, LRU order.

Its one lock guards everything here; the I/O threads never touch the index except through
these methods. A slot is in exactly one of four states::

    free --reserve--> reserved --commit--> committed --free / corrupt--> free
                          |                    |  ^
                          +------abort---------+  | (readers > 0: the slot returns
                                 (to free)         |  when the last read finishes)

A committed slot being read is *pinned* (``readers``): freeing it unmaps the key at once (later
lookups miss) but the slot is handed out again only after the last read of it has finished, so
a write never lands under a read in flight.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class Entry:
    """A committed page: its slot and generation, and how many reads are in flight on it."""

    slot: int
    generation: int
    readers: int = 0
    mapped: bool = True  # False once freed: the slot returns when readers drop to 0
    damaged: bool = False  # a read found it damaged (counted once)


class Reserved(NamedTuple):
    """A slot reserved for a key's write: `slot` is -1 when none was given (`why` says). A
    tuple: a write builds one per page."""

    key: bytes
    slot: int
    generation: int
    why: str = ""  # "", "present", "busy" or "no_room"


class SlotIndex:
    """Who holds which slot. Thread-safe; every method is O(keys) under one lock."""

    def __init__(self, capacity: int, next_generation: int = 1) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._committed: OrderedDict[bytes, Entry] = OrderedDict()  # oldest first
        self._reserved: dict[bytes, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # lowest slot popped first
        self._next_gen = next_generation

    def load(self, found: Iterable[tuple[bytes, int, int]], next_generation: int) -> None:
        """Start from `found` (key, slot, generation) recovered at open, oldest first; the
        other slots are free."""
        with self._lock:
            used: set[int] = set()
            for key, slot, gen in found:
                self._committed[key] = Entry(slot, gen)
                used.add(slot)
            self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
            self._next_gen = next_generation

    # -- reads ---------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot of each committed key, None for the others."""
        with self._lock:
            out: list[int | None] = []
            for k in keys:
                e = self._committed.get(k)
                out.append(None if e is None else e.slot)
            return out

    def pin(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Pin each committed key for a read (and make it the most recently used)."""
        with self._lock:
            out: list[Entry | None] = []
            for k in keys:
                e = self._committed.get(k)
                if e is not None:
                    e.readers += 1
                    self._committed.move_to_end(k)
                out.append(e)
            return out

    def unpin(self, pairs: Iterable[tuple[bytes, Entry, bool]]) -> list[bool]:
        """End reads: each (key, entry, good). A bad read drops the key (its bytes are damaged);
        a dropped entry's slot is free once no read holds it. Returns, per pair, whether it is
        the first bad read of that entry (two reads of one damaged page count it once)."""
        first: list[bool] = []
        with self._lock:
            for key, e, good in pairs:
                e.readers -= 1
                first.append(not good and not e.damaged)
                if not good:
                    e.damaged = True
                    if e.mapped:
                        self._unmap(key, e)
                if not e.mapped and e.readers == 0:
                    self._free.append(e.slot)
        return first

    # -- writes --------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[bytes]) -> list[Reserved]:
        """A free slot and a new generation for each key that is neither stored nor being
        written (a key twice in `keys` counts as being written the second time). The slots
        given to one call ascend with the keys' order, so that adjacent ones move in one call."""
        with self._lock:
            why: list[str] = []
            seen: set[bytes] = set()
            for k in keys:
                if k in self._committed:
                    why.append("present")
                elif k in self._reserved or k in seen:
                    why.append("busy")
                else:
                    why.append("")
                    seen.add(k)
            wanted = why.count("")
            take = min(wanted, len(self._free))
            slots = sorted(self._free[len(self._free) - take :]) if take else []
            del self._free[len(self._free) - take :]
            out: list[Reserved] = []
            given = 0
            for k, w in zip(keys, why, strict=True):
                if w:
                    out.append(Reserved(k, -1, 0, w))
                elif given == take:
                    out.append(Reserved(k, -1, 0, "no_room"))
                else:
                    slot = slots[given]
                    given += 1
                    self._reserved[k] = slot
                    out.append(Reserved(k, slot, self._next_gen))
                    self._next_gen += 1
            return out

    def finish(self, done: Iterable[tuple[Reserved, bool]]) -> None:
        """Commit (True) or abort (False) reservations; an aborted slot is free again."""
        with self._lock:
            for r, ok in done:
                if r.slot < 0 or self._reserved.get(r.key) != r.slot:
                    continue
                del self._reserved[r.key]
                if ok:
                    self._committed[r.key] = Entry(r.slot, r.generation)
                else:
                    self._free.append(r.slot)

    # -- eviction ------------------------------------------------------------------------------

    def free(self, keys: Iterable[bytes]) -> int:
        """Drop committed keys; returns how many were held. A slot being read returns to the
        free list when its last read finishes."""
        n = 0
        with self._lock:
            for k in keys:
                e = self._committed.get(k)
                if e is not None:
                    self._unmap(k, e)
                    if e.readers == 0:
                        self._free.append(e.slot)
                    n += 1
        return n

    def victims(self, n: int) -> list[bytes]:
        """Up to `n` committed keys, least recently used first, that no read holds."""
        with self._lock:
            out: list[bytes] = []
            for k, e in self._committed.items():
                if len(out) >= n:
                    break
                if e.readers == 0:
                    out.append(k)
            return out

    def _unmap(self, key: bytes, e: Entry) -> None:
        del self._committed[key]
        e.mapped = False

    # -- accounting ----------------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int]:
        """(committed, reserved, free) slots; the rest are freed slots still being read."""
        with self._lock:
            return len(self._committed), len(self._reserved), len(self._free)

    def check(self) -> None:
        """Assert the invariants: every slot in exactly one state. For tests."""
        with self._lock:
            held = [e.slot for e in self._committed.values()] + list(self._reserved.values())
            assert len(set(held)) == len(held), "a slot held twice"
            assert not set(held) & set(self._free), "a held slot is free"
            assert len(set(self._free)) == len(self._free), "a slot free twice"
            assert len(held) + len(self._free) <= self.capacity
