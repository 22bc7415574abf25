"""S3-FIFO: three static FIFO queues (Yang et al., SOSP'23)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierkv.policies.base import CanEvictSlot, EvictionPolicy, Hints, Key
from tierkv.policies.history import History
from tierkv.policies.links import Links

MAX_FREQ = 3
_S, _M = 0, 1  # the small and main queues (of Links)


class S3FIFOPolicy(EvictionPolicy):
    """Quick demotion of one-hit wonders through a small probationary FIFO.

    ::

        new page -> S (small, 10%) --used since insert--> M (main, 90%) --freq>0--> M again
                      |  not used                          | freq 0
                      v                                    v
                   G (ghost keys, |M| entries)           evicted
        page remembered in G -> straight into M

    Each resident page has a use counter capped at 3. Eviction takes from S while S holds at
    least 10% of the capacity, otherwise from M; M's tail page is reinserted with its counter
    decremented while the counter is positive. Pinned pages are moved to the head of their queue
    as they are skipped, keeping their counter; all work is O(1) amortized. When neither queue
    yields a victim but S promoted used pages to M on the way, M is tried again: a promoted page
    may go at once. S and M are queues of slots (``links.py``); G holds keys.

    Args:
        capacity: pages the tier holds; ``None`` learns it as the high-water mark.
        small_ratio: the share of the capacity given to S.
    """

    name = "s3fifo"

    def __init__(self, capacity: int | None = None, small_ratio: float = 0.1) -> None:
        self._c = capacity or 0
        self._fixed = capacity is not None
        self._ratio = small_ratio
        self._links = Links(0, 2)
        self._freq: list[int] = []
        self._key: list[Key] = []
        self._ghost = History()
        self._promoted = False  # S moved a used page to M during this eviction
        self._after: dict[int, int] = {}  # chosen victim -> the slot it was behind

    def bind_slots(self, capacity: int, slot_of: Mapping[Key, int]) -> None:
        self._bind(capacity, slot_of)
        self._links = Links(capacity, 2)
        self._freq = [0] * capacity
        self._key = [None] * capacity

    def __len__(self) -> int:
        size = self._links.size
        return size[_S] + size[_M]

    def holds(self, s: int) -> bool:
        return self._links.linked(s)

    def insert_slots(self, slots: Sequence[int], keys: Sequence[Key], hints: Hints) -> None:
        ghost, links, freq, key_of = self._ghost, self._links, self._freq, self._key
        ghosts = ghost.value  # membership read from the dict (no method call)
        for s, k in zip(slots, keys):
            key_of[s] = k
            freq[s] = 0
            if ghosts and k in ghosts:
                ghost.pop(k)
                links.append(_M, s)
            else:
                links.append(_S, s)
        n = len(self)
        if not self._fixed and n > self._c:
            self._c = n

    def touch_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        freq = self._freq
        for s in slots:
            if freq[s] < MAX_FREQ:
                freq[s] += 1

    def remove_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._links.unlink_many(slots)

    def _remember(self, key: Key) -> None:
        ghost = self._ghost
        ghost.put(key, 0)
        ghost.trim(max(1, self._c - int(self._c * self._ratio)))

    def _evict_small(self, can_evict: CanEvictSlot | None) -> int:
        links, freq = self._links, self._freq
        for _ in range(links.size[_S]):
            s = links.head(_S)
            links.unlink(s)
            if can_evict is not None and not can_evict(s):
                links.append(_S, s)
            elif freq[s] > 0:
                freq[s] = 0
                links.append(_M, s)
                self._promoted = True
            else:
                self._remember(self._key[s])
                return s
        return -1

    def _evict_main(self, can_evict: CanEvictSlot | None) -> int:
        links, freq = self._links, self._freq
        # Each page is passed over at most MAX_FREQ times before it goes or is skipped as pinned.
        for _ in range((MAX_FREQ + 1) * links.size[_M]):
            s = links.head(_M)
            if s < 0:
                break
            if can_evict is not None and not can_evict(s):
                links.move(_M, s)
            elif freq[s] > 0:
                freq[s] -= 1
                links.move(_M, s)
            else:
                links.unlink(s)
                return s
        return -1

    def _evict_one(self, can_evict: CanEvictSlot | None) -> int:
        self._promoted = False
        if self._links.size[_S] >= self._c * self._ratio:
            s = self._evict_small(can_evict)
            if s < 0:
                s = self._evict_main(can_evict)
        else:
            s = self._evict_main(can_evict)
            if s < 0:
                s = self._evict_small(can_evict)
                if s < 0 and self._promoted:  # S moved evictable pages into M
                    s = self._evict_main(can_evict)
        return s

    def evict_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        if self._after:
            self._after = {}
        out: list[int] = []
        while len(out) < n:
            s = self._evict_one(can_evict)
            if s < 0:
                break
            out.append(s)
        return out

    def candidate_slots(self, n: int, can_evict: CanEvictSlot | None) -> list[int]:
        clone = S3FIFOPolicy.__new__(S3FIFOPolicy)  # evict on a copy: O(pages)
        clone.__dict__.update(self.__dict__)
        clone._links = self._links.copy()
        clone._freq = list(self._freq)
        clone._ghost = History()  # the ghost list never steers a victim
        return clone.evict_slots(n, can_evict)

    def evict_chosen(self, slots: Sequence[int]) -> list[int]:
        """Take ``slots`` from where they are in S / M, counters as they are (the default
        scan promoted chosen pages of S that were used and moved the pages it passed); one
        from S is remembered in G as an eviction from S is."""
        out = list(slots)
        queue, key_of = self._links.queue, self._key
        small = [queue[s] == _S for s in out]
        self._after = dict(zip(out, self._links.cut(out)))
        for s, from_small in zip(out, small):
            if from_small:
                self._remember(key_of[s])
        return out

    def evicted_state_slots(self, slots: Sequence[int], keys: Sequence[Key]) -> list[object]:
        queue, freq, after = self._links.queue, self._freq, self._after  # (kept until reuse)
        return [(queue[s], freq[s], after.get(s, -1)) for s in slots]

    def restore_slots(
        self, slots: Sequence[int], keys: Sequence[Key], states: Sequence[object]
    ) -> None:
        for s, k, state in zip(reversed(slots), reversed(keys), reversed(states)):
            assert isinstance(state, tuple)
            which, count, after = state
            if which == _S:
                self._ghost.pop(k)  # the ghost entry its eviction made
            self._key[s] = k
            self._links.put_after(_S if which == _S else _M, s, after)
            self._freq[s] = count  # (0 for a victim the policy chose)
