"""S3-FIFO: three static FIFO queues (Yang et al., SOSP'23)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tierkv.policies.base import NO_HINT, CanEvict, Key, OneByOne, PageHint, unknown

MAX_FREQ = 3


class S3FIFOPolicy(OneByOne):
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
    may go at once.

    Args:
        capacity: pages the tier holds; ``None`` learns it as the high-water mark.
        small_ratio: the share of the capacity given to S.
    """

    name = "s3fifo"

    def __init__(self, capacity: int | None = None, small_ratio: float = 0.1) -> None:
        self._c = capacity or 0
        self._fixed = capacity is not None
        self._ratio = small_ratio
        self._freq: dict[Key, int] = {}
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._recent: dict[Key, object] = {}  # the last eviction call's victims -> from S
        self._promoted = False  # S moved a used page to M during this eviction

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0
        if not self._fixed and len(self._freq) > self._c:
            self._c = len(self._freq)

    def touch(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is None:
            raise unknown(key, self.name)
        if f < MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        if key not in self._freq:
            raise unknown(key, self.name)
        del self._freq[key]
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def _remember(self, key: Key) -> None:
        ghost = self._ghost
        ghost[key] = None
        limit = max(1, self._c - int(self._c * self._ratio))
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def _evict_small(self, can_evict: CanEvict) -> Key | None:
        small, freq = self._small, self._freq
        for _ in range(len(small)):
            key = next(iter(small))
            del small[key]
            if not can_evict(key):
                small[key] = None
            elif freq[key] > 0:
                freq[key] = 0
                self._main[key] = None
                self._promoted = True
            else:
                del freq[key]
                self._remember(key)
                return key
        return None

    def _evict_main(self, can_evict: CanEvict) -> Key | None:
        main, freq = self._main, self._freq
        # Each page is passed over at most MAX_FREQ times before it goes or is skipped as pinned.
        for _ in range((MAX_FREQ + 1) * len(main)):
            if not main:
                break
            key = next(iter(main))
            main.move_to_end(key)
            if not can_evict(key):
                continue
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
            else:
                del main[key]
                del freq[key]
                return key
        return None

    def _evict_one(self, can_evict: CanEvict) -> Key | None:
        self._promoted = False
        from_small = len(self._small) >= self._c * self._ratio
        if from_small:
            key = self._evict_small(can_evict)
            if key is None:
                key = self._evict_main(can_evict)
                from_small = False
        else:
            key = self._evict_main(can_evict)
            if key is None:
                key = self._evict_small(can_evict)
                from_small = True
                if key is None and self._promoted:  # S moved evictable pages into M
                    key = self._evict_main(can_evict)
                    from_small = False
        if key is not None:
            self._recent[key] = from_small
        return key

    def restore(self, keys: Sequence[Key], states: Sequence[object]) -> None:
        for k, from_small in zip(reversed(keys), reversed(states)):
            if from_small:
                self._ghost.pop(k, None)  # the ghost entry its eviction made
                queue = self._small
            else:
                queue = self._main
            queue[k] = None
            queue.move_to_end(k, last=False)  # the head of the queue it left
            self._freq[k] = 0  # a victim's counter was 0

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
