"""Queues of slots as intrusive doubly linked lists: the one list structure of the policies.

A policy bound to a page table's tier knows its pages by slot (small ints). :class:`Links`
keeps any number of FIFO queues over those slots in two flat int lists, with one sentinel per
queue after the slots (as vLLM's ``FreeKVCacheBlockQueue``), so a use, a move between queues or
an eviction allocates no object and never hashes a key::

    next:  H ──> s0 ──> s1 ──> ... ──> sk ──> H      H = capacity + q (queue q's sentinel)
           head (oldest)                tail (newest)
    prev[s] == UNLINKED: slot s is in no queue

Every splice lives here, once; the batch methods (:meth:`Links.move_to_back`,
:meth:`Links.take`, :meth:`Links.extend`) run their loop inside one call, which is what keeps
LRU at list speed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence

UNLINKED = -1
"""``prev[s]`` of a slot that is in no queue."""


class Links:
    """``queues`` FIFO queues over slots ``0 .. capacity - 1`` (a slot is in one queue at most).

    Args:
        flat: keep the links in ``array('q')``s instead of lists: a collector pass visits each
            as one object instead of walking its entries, and C code reads them as memory
            (kvaware's loops, ``_kvaware.c``); Python indexing is a little slower (an int is
            made per read).

    Attributes:
        prev, next: the links; ``next[capacity + q]`` is queue ``q``'s head, ``prev[...]`` its
            tail. Read them to walk a queue; change them only through the methods.
        size: pages per queue.
        queue: the queue each linked slot is in.
    """

    __slots__ = ("base", "next", "prev", "queue", "size")

    def __init__(self, capacity: int, queues: int = 1, flat: bool = False) -> None:
        self.base = capacity
        n = capacity + queues
        self.prev: MutableSequence[int] = _ints([UNLINKED], n, flat)
        self.next: MutableSequence[int] = _ints([UNLINKED], n, flat)
        for h in range(capacity, n):
            self.prev[h] = self.next[h] = h
        self.size: MutableSequence[int] = _ints([0], queues, flat)
        self.queue: MutableSequence[int] = _ints([0], capacity, flat)

    def copy(self) -> Links:
        """An independent copy (flat if this one is)."""
        c = Links.__new__(Links)
        c.base = self.base
        c.prev, c.next = self.prev[:], self.next[:]
        c.size, c.queue = self.size[:], self.queue[:]
        return c

    def linked(self, s: int) -> bool:
        """Whether slot ``s`` is in a queue."""
        return self.prev[s] != UNLINKED

    def head(self, q: int) -> int:
        """The oldest slot of queue ``q``, or -1 when it is empty."""
        s = self.next[self.base + q]
        return -1 if s >= self.base else s

    def walk(self, q: int) -> Iterator[int]:
        """The slots of queue ``q``, oldest first (do not change the queue meanwhile)."""
        nxt, h = self.next, self.base + q
        s = nxt[h]
        while s != h:
            yield s
            s = nxt[s]

    def append(self, q: int, s: int) -> None:
        """Put slot ``s`` (in no queue) at the tail of queue ``q``."""
        prv, nxt = self.prev, self.next
        h = self.base + q
        t = prv[h]
        nxt[t] = s
        prv[s] = t
        nxt[s] = h
        prv[h] = s
        self.queue[s] = q
        self.size[q] += 1

    def appendleft(self, q: int, s: int) -> None:
        """Put slot ``s`` (in no queue) at the head of queue ``q``."""
        self._link_after(self.base + q, q, s)

    def _link_after(self, p: int, q: int, s: int) -> None:
        """Link slot ``s`` (in no queue) into queue ``q`` right behind ``p`` (a slot of ``q``
        or its sentinel)."""
        prv, nxt = self.prev, self.next
        n = nxt[p]
        nxt[p] = s
        prv[s] = p
        nxt[s] = n
        prv[n] = s
        self.queue[s] = q
        self.size[q] += 1

    def extend(self, q: int, slots: Iterable[int]) -> None:
        """Append ``slots`` (in no queue), in order, at the tail of queue ``q``."""
        prv, nxt, queue = self.prev, self.next, self.queue
        h = self.base + q
        t = prv[h]
        k = 0
        for s in slots:
            nxt[t] = s
            prv[s] = t
            queue[s] = q
            t = s
            k += 1
        nxt[t] = h
        prv[h] = t
        self.size[q] += k

    def extendleft(self, q: int, slots: Sequence[int]) -> None:
        """Put ``slots`` (in no queue) at the head of queue ``q``, ``slots[0]`` first."""
        prv, nxt, queue = self.prev, self.next, self.queue
        p = self.base + q
        for s in slots:
            n = nxt[p]
            nxt[p] = s
            prv[s] = p
            nxt[s] = n
            prv[n] = s
            queue[s] = q
            p = s
        self.size[q] += len(slots)

    def unlink(self, s: int) -> int:
        """Take slot ``s`` out of its queue; returns that queue."""
        prv, nxt = self.prev, self.next
        p = prv[s]
        n = nxt[s]
        nxt[p] = n
        prv[n] = p
        prv[s] = UNLINKED
        q = self.queue[s]
        self.size[q] -= 1
        return q

    def unlink_many(self, slots: Iterable[int]) -> None:
        """Take every slot of ``slots`` out of its queue."""
        prv, nxt, queue, size = self.prev, self.next, self.queue, self.size
        for s in slots:
            p = prv[s]
            n = nxt[s]
            nxt[p] = n
            prv[n] = p
            prv[s] = UNLINKED
            size[queue[s]] -= 1

    def cut(self, slots: Iterable[int]) -> list[int]:
        """Take every slot of ``slots`` out of its queue, in order, where it is (nothing else
        moves); returns the slot each was behind when it left (``-1``: it was its queue's
        head). :meth:`put_after`, in reverse order, undoes it."""
        prv, base, unlink = self.prev, self.base, self.unlink
        after: list[int] = []
        for s in slots:
            p = prv[s]
            unlink(s)
            after.append(-1 if p >= base else p)
        return after

    def put_after(self, q: int, s: int, after: int) -> None:
        """Put slot ``s`` (in no queue) into queue ``q`` right behind slot ``after`` when that
        one is in ``q``; at the head of ``q`` otherwise (``after`` -1: the head)."""
        p = after if 0 <= after < self.base and self.prev[after] != UNLINKED else -1
        self._link_after(p if p >= 0 and self.queue[p] == q else self.base + q, q, s)

    def put_before(self, q: int, s: int, before: int) -> None:
        """Put slot ``s`` (in no queue) into queue ``q`` right ahead of slot ``before`` when
        that one is in ``q`` (``q``'s sentinel: at the tail); at the head of ``q`` otherwise.
        An unlinked slot's ``next`` still names the slot it was ahead of when it left, so
        putting victims back this way, in reverse order, undoes their unlinking."""
        h = self.base + q
        ok = before == h or (0 <= before < self.base and self.prev[before] != UNLINKED)
        if not ok or (before != h and self.queue[before] != q):
            self.put_after(q, s, -1)
            return
        p = self.prev[before]
        self.put_after(q, s, -1 if p == h else p)

    def move(self, q: int, s: int) -> None:
        """Move linked slot ``s`` to the tail of queue ``q`` (from any queue)."""
        prv, nxt, queue, size = self.prev, self.next, self.queue, self.size
        p = prv[s]
        n = nxt[s]
        nxt[p] = n
        prv[n] = p
        h = self.base + q
        t = prv[h]
        nxt[t] = s
        prv[s] = t
        nxt[s] = h
        prv[h] = s
        size[queue[s]] -= 1
        size[q] += 1
        queue[s] = q

    def move_to_back(self, q: int, slots: Iterable[int]) -> None:
        """Move linked ``slots``, in order, to the tail of queue ``q`` (from any queue; a slot
        named twice ends where its last mention puts it)."""
        prv, nxt, queue, size = self.prev, self.next, self.queue, self.size
        h = self.base + q
        t = prv[h]  # the tail; its own next link is stale until the end
        for s in slots:
            if s == t:
                continue
            p = prv[s]
            n = nxt[s]
            nxt[p] = n
            prv[n] = p
            nxt[t] = s
            prv[s] = t
            t = s
            qs = queue[s]
            if qs != q:
                size[qs] -= 1
                size[q] += 1
                queue[s] = q
        nxt[t] = h
        prv[h] = t

    def take(
        self,
        q: int,
        n: int,
        can_go: Callable[[int], bool] | None,
        one_by_one: bool = False,
    ) -> list[int]:
        """Unlink and return up to ``n`` slots from the head of queue ``q`` for which
        ``can_go`` is true (every slot when None); the slots passed over on the way go to the
        tail, in order. Looks at each slot once at most.

        ``one_by_one``: leave the queue as ``n`` scans for one slot each would (each moving
        the slots it passes over to the tail at once): when the queue runs out, the slots
        passed after the last one taken end up ahead of those passed before it (the scans
        after the last one taken went round the whole queue)."""
        prv, nxt, size = self.prev, self.next, self.size
        h = self.base + q
        out: list[int] = []
        s = nxt[h]
        if can_go is None:
            for _ in range(min(n, size[q])):
                out.append(s)
                prv[s] = UNLINKED
                s = nxt[s]
            nxt[h] = s
            prv[s] = h
            size[q] -= len(out)
            return out
        passed: list[int] = []
        cut = 0  # slots passed before the last one taken
        for _ in range(size[q]):
            if len(out) >= n:
                break
            after = nxt[s]
            if can_go(s):
                out.append(s)
                prv[s] = UNLINKED
                cut = len(passed)
            else:
                passed.append(s)
            s = after
        nxt[h] = s  # cut the scanned run off the front
        prv[s] = h
        size[q] -= len(out) + len(passed)
        if passed:
            if one_by_one and len(out) < n and cut:
                passed = passed[cut:] + passed[:cut]
            self.extend(q, passed)
        return out

    def peek(self, q: int, n: int, can_go: Callable[[int], bool] | None) -> list[int]:
        """The slots :meth:`take` would return, without changing anything."""
        nxt, h = self.next, self.base + q
        out: list[int] = []
        s = nxt[h]
        while s != h and len(out) < n:
            if can_go is None or can_go(s):
                out.append(s)
            s = nxt[s]
        return out


def _ints(fill: list[int], n: int, flat: bool) -> MutableSequence[int]:
    """``n`` copies of ``fill[0]``: a list, or an ``array('q')`` when ``flat``."""
    return array("q", fill) * n if flat else fill * n
