"""Reference eviction policies: plain lists and linear scans, slow and easy to check by eye.

Each one states, in a few lines, the rules its optimised twin in ``tierkv.policies`` keeps with
buckets, bit masks and intrusive lists of slots. The references work on keys; :class:`KeyPolicy`
binds one to a page table's tier (the slot interface every policy has), so the differential
tests run both behind the same page table and require the same victims, op for op. Shared rules
(``tierkv/policies/base.py``):

* a page passed over because it may not be evicted goes to the back of its queue;
* ``restore`` puts victims back at the head of the queue they left, counters unchanged, and
  takes back the ghost / history entry their eviction made (the references take no victims
  from the middle of a queue: ``evict_chosen`` and putting those back where they were are
  tested on the policies themselves, test_evict_order.py);
* ``candidates`` is what ``evict_many`` would return now (here: literally, on a deep copy).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tierkv.errors import UnknownPageError
from tierkv.policies import NO_HINT, CanEvictSlot, EvictionPolicy, Key, PageHint
from tierkv.policies.base import Hints, page_hints

CanEvict = Callable[[Key], bool]


def _unknown(key: Key) -> UnknownPageError:
    return UnknownPageError(f"reference policy holds no page {key!r}")


class KeyPolicy(EvictionPolicy):
    """A key-based policy (``insert``, ``touch``, ``remove``, ``evict_many``, ``restore``, ...)
    behind the slot interface: slots are translated to keys and back through the tier's map."""

    admits = True

    def __init__(self, ref: Any, name: str | None = None) -> None:
        self.ref = ref
        self.name = name or ref.name  # type: ignore[misc]
        self._key: list[Key] = []

    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        self._bind(capacity, slot_of)
        self._key = [None] * capacity

    def _keyed(self, can_evict: CanEvictSlot | None) -> CanEvict:
        slot_of = self._slot_of
        if can_evict is None:
            return lambda k: True
        return lambda k: can_evict(slot_of[k])

    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        for s, k in zip(slots, keys):
            self._key[s] = k
        self.ref.insert_many(keys, page_hints(keys, hints))

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self.ref.touch_many(keys)

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        for s, k in zip(slots, keys):
            self._key[s] = None
            self.ref.remove(k)

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        keys = self.ref.evict_many(n, self._keyed(can_evict))
        slots = [self._slot_of[k] for k in keys]
        for s in slots:
            self._key[s] = None
        return slots

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        return [self._slot_of[k] for k in self.ref.candidates(n, self._keyed(can_evict))]

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        return list(self.ref.evicted_state(keys))

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        for s, k in zip(slots, keys):
            self._key[s] = k
        self.ref.restore(keys, states)

    def admit_many(self, keys: Sequence[Key], hints: Hints) -> list[bool] | None:
        # every key, hinted or not (ARC adapts on a ghost either way)
        kept = [self.ref.admit(k, h) for k, h in zip(keys, page_hints(keys, hints))]
        return None if all(kept) else kept

    def end_batch(self) -> None:
        self.ref.end_batch()

    def miss(self, keys: Iterable[Key]) -> None:
        self.ref.miss(keys)

    def stats(self) -> dict[str, float]:
        return dict(self.ref.stats())

    def __len__(self) -> int:
        return len(self.ref)

    def holds(self, s: int) -> bool:
        return self._key[s] is not None and self._key[s] in self.ref


class _Ref:
    """evict / candidates from one ``_evict_one`` rule; victims remembered for restore."""

    name = "ref"

    def __init__(self) -> None:
        self.recent: dict[Key, object] = {}

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        return True

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        raise NotImplementedError

    def touch(self, key: Key) -> None:
        raise NotImplementedError

    def insert_many(self, keys: Sequence[Key], hints: Sequence[PageHint]) -> None:
        for k, h in zip(keys, hints):
            self.insert(k, h)

    def touch_many(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self.touch(k)

    def end_batch(self) -> None:
        return None

    def miss(self, keys: Iterable[Key]) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}

    def _evict_one(self, can_evict: CanEvict) -> tuple[Key, object] | None:
        raise NotImplementedError

    def evict(self, can_evict: CanEvict) -> Key | None:
        out = self.evict_many(1, can_evict)
        return out[0] if out else None

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        self.recent = {}
        out: list[Key] = []
        while len(out) < n:
            got = self._evict_one(can_evict)
            if got is None:
                break
            self.recent[got[0]] = got[1]
            out.append(got[0])
        return out

    def evicted_state(self, keys: Sequence[Key]) -> list[object]:
        return [self.recent[k] for k in keys]

    def candidates(self, n: int, can_evict: CanEvict | None = None) -> list[Key]:
        return copy.deepcopy(self).evict_many(n, can_evict or (lambda k: True))


class RefLRU(_Ref):
    """The least recently used evictable page goes."""

    name = "ref-lru"

    def __init__(self) -> None:
        super().__init__()
        self.order: list[Key] = []  # least recent first

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self.order.append(key)

    def touch(self, key: Key) -> None:
        if key not in self.order:
            raise _unknown(key)
        self.order.remove(key)
        self.order.append(key)

    def remove(self, key: Key) -> None:
        if key not in self.order:
            raise _unknown(key)
        self.order.remove(key)

    def evict_many(self, n: int, can_evict: CanEvict) -> list[Key]:
        # one scan: victims leave, pages passed over go to the back together
        self.recent = {}
        out: list[Key] = []
        passed: list[Key] = []
        for k in list(self.order):
            if len(out) >= n:
                break
            self.order.remove(k)
            (out if can_evict(k) else passed).append(k)
        self.order.extend(passed)
        self.recent = dict.fromkeys(out)
        return out

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        self.order[0:0] = list(keys)

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order


class RefLFU(_Ref):
    """Fewest uses first (counts 1..15), then least recent; counts outlive residency in a
    history of ``8 x`` the largest resident count, oldest entries dropped first."""

    name = "ref-lfu"

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[Key, int] = {}
        self.stamp: dict[Key, int] = {}
        self.clock = 0
        self.front = 0
        self.capacity = 0
        self.gone: OrderedDict[Key, int] = OrderedDict()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self.count[key] = min(self.gone.pop(key, 0) + 1, 15)
        self.stamp[key] = self._tick()
        self.capacity = max(self.capacity, len(self.count))

    def touch(self, key: Key) -> None:
        if key not in self.count:
            raise _unknown(key)
        self.count[key] = min(self.count[key] + 1, 15)
        self.stamp[key] = self._tick()

    def _forget(self, key: Key) -> int:
        c = self.count.pop(key)
        del self.stamp[key]
        self.gone[key] = c
        while len(self.gone) > 8 * self.capacity:
            self.gone.popitem(last=False)
        return c

    def remove(self, key: Key) -> None:
        if key not in self.count:
            raise _unknown(key)
        self._forget(key)

    def _evict_one(self, can_evict: CanEvict) -> tuple[Key, object] | None:
        for c in range(1, 16):
            for k in sorted((k for k in self.count if self.count[k] == c), key=self.stamp.get):
                if can_evict(k):
                    return k, self._forget(k)
                self.stamp[k] = self._tick()  # passed over: to the back of its count
        return None

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        for k, c in zip(reversed(keys), reversed(states)):
            assert isinstance(c, int)
            self.gone.pop(k, None)
            self.count[k] = c
            self.front -= 1
            self.stamp[k] = self.front  # ahead of every page of its count

    def __len__(self) -> int:
        return len(self.count)

    def __contains__(self, key: object) -> bool:
        return key in self.count


class RefARC(_Ref):
    """ARC as in the paper (T1, T2, ghosts B1, B2, target p), with the page table's split of a
    miss into admit (adapt), evict and insert; a ghost's feedback counts once until inserted."""

    name = "ref-arc"

    def __init__(self) -> None:
        super().__init__()
        self.c = 0
        self.p = 0.0
        self.t1: list[Key] = []
        self.t2: list[Key] = []
        self.b1: list[Key] = []
        self.b2: list[Key] = []
        self.adapted: Key | None = None
        self.fed: set[Key] = set()

    def _adapt(self, key: Key) -> None:
        if key in self.fed:
            return
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
        else:
            return
        self.adapted = key
        if len(self.fed) > 2 * self.c + 64:
            self.fed.clear()
        self.fed.add(key)

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        self._adapt(key)
        return True

    def miss(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self._adapt(k)

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self._adapt(key)
        self.adapted = None
        self.fed.discard(key)
        if key in self.b1:
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:
            self.b2.remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
        resident = len(self.t1) + len(self.t2)
        self.c = max(self.c, resident)
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.pop(0)
        while self.b2 and resident + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.pop(0)

    def touch(self, key: Key) -> None:
        if key in self.t1:
            self.t1.remove(key)
        elif key in self.t2:
            self.t2.remove(key)
        else:
            raise _unknown(key)
        self.t2.append(key)

    def remove(self, key: Key) -> None:
        for lst in (self.t1, self.t2):
            if key in lst:
                lst.remove(key)
                return
        raise _unknown(key)

    def _evict_one(self, can_evict: CanEvict) -> tuple[Key, object] | None:
        t1 = len(self.t1)
        in_b2 = self.adapted is not None and self.adapted in self.b2
        first = bool(t1) and (t1 > self.p or (in_b2 and t1 == int(self.p)))
        lists = [(self.t1, self.b1, 1), (self.t2, self.b2, 2)]
        for lst, ghosts, which in lists if first else lists[::-1]:
            for k in list(lst):
                lst.remove(k)
                if can_evict(k):
                    ghosts.append(k)
                    return k, which
                lst.append(k)
        return None

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        for k, which in zip(reversed(keys), reversed(states)):
            lst, ghosts = (self.t1, self.b1) if which == 1 else (self.t2, self.b2)
            if k in ghosts:
                ghosts.remove(k)
            lst.insert(0, k)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


class RefS3FIFO(_Ref):
    """S3-FIFO (SOSP'23): small FIFO S (10%), main FIFO M, ghost G; counters capped at 3."""

    name = "ref-s3fifo"

    def __init__(self) -> None:
        super().__init__()
        self.c = 0
        self.freq: dict[Key, int] = {}
        self.small: list[Key] = []
        self.main: list[Key] = []
        self.ghost: list[Key] = []
        self.promoted = False

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.append(key)
        else:
            self.small.append(key)
        self.freq[key] = 0
        self.c = max(self.c, len(self.freq))

    def touch(self, key: Key) -> None:
        if key not in self.freq:
            raise _unknown(key)
        self.freq[key] = min(self.freq[key] + 1, 3)

    def remove(self, key: Key) -> None:
        if key not in self.freq:
            raise _unknown(key)
        del self.freq[key]
        (self.small if key in self.small else self.main).remove(key)

    def _from_small(self, can_evict: CanEvict) -> Key | None:
        for _ in range(len(self.small)):
            k = self.small.pop(0)
            if not can_evict(k):
                self.small.append(k)
            elif self.freq[k] > 0:
                self.freq[k] = 0
                self.main.append(k)
                self.promoted = True
            else:
                del self.freq[k]
                self.ghost.append(k)
                while len(self.ghost) > max(1, self.c - int(self.c * 0.1)):
                    self.ghost.pop(0)
                return k
        return None

    def _from_main(self, can_evict: CanEvict) -> Key | None:
        for _ in range(4 * len(self.main)):
            if not self.main:
                break
            k = self.main.pop(0)
            self.main.append(k)
            if not can_evict(k):
                continue
            if self.freq[k] > 0:
                self.freq[k] -= 1
            else:
                self.main.pop()
                del self.freq[k]
                return k
        return None

    def _evict_one(self, can_evict: CanEvict) -> tuple[Key, object] | None:
        self.promoted = False
        if len(self.small) >= self.c * 0.1:
            k = self._from_small(can_evict)
            if k is not None:
                return k, True
            k = self._from_main(can_evict)
            return None if k is None else (k, False)
        k = self._from_main(can_evict)
        if k is not None:
            return k, False
        k = self._from_small(can_evict)
        if k is not None:
            return k, True
        if self.promoted:
            k = self._from_main(can_evict)
            return None if k is None else (k, False)
        return None

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        for k, from_small in zip(reversed(keys), reversed(states)):
            if from_small and k in self.ghost:
                self.ghost.remove(k)
            (self.small if from_small else self.main).insert(0, k)
            self.freq[k] = 0

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: object) -> bool:
        return key in self.freq


def _kvaware() -> EvictionPolicy:
    from kvaware_ref import RefKVAware  # the policy as it ran on keys (not list-based)

    return KeyPolicy(RefKVAware())


REFERENCES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": lambda: KeyPolicy(RefLRU()),
    "lfu": lambda: KeyPolicy(RefLFU()),
    "arc": lambda: KeyPolicy(RefARC()),
    "s3fifo": lambda: KeyPolicy(RefS3FIFO()),
    "kvaware": _kvaware,
}
"""Each built-in policy's reference, by the built-in's name, bound through :class:`KeyPolicy`
(kvaware's is its former key-based implementation, ``kvaware_ref.py``)."""
