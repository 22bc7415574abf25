"""Lease admission: backpressure on the device tier, first come first served.

Every active lease holds a *footprint* on the device: the pages it pins plus the pages its
sequences' declared tokens will open (at least one token per sequence and layer). A lease is
admitted when its footprint fits beside the footprints already admitted; otherwise it waits, in
arrival order, for leases to end::

    capacity  [##### lease A #####][#### lease B ####][ free ]       C needs 6, 4 free:
    waiters   C(6) -> D(2)                                          C waits, D waits behind C

    A ends    [#### lease B ####][          free           ]        C fits: admitted, then D

The head of the queue is admitted as soon as it fits (or when no lease is active: a lease alone
is never refused for its reserve, only for pins it could never hold); a later, smaller request
never overtakes it. Waiting is cancellable and bounded by a deadline; a waiter removed for any
reason (admitted, cancelled, timed out) wakes the next one in ``finally``, so no wakeup is lost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Waiter:
    pages: int
    fut: asyncio.Future[None]


class Admission:
    """FIFO admission of leases by device footprint. Used from one event loop.

    Args:
        capacity: device tier capacity in pages.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.committed = 0  # footprints of the admitted leases
        self.active = 0  # admitted leases
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Leases waiting for admission."""
        return len(self._queue)

    def _fits(self, pages: int) -> bool:
        return self.active == 0 or self.committed + pages <= self.capacity

    async def enter(self, pages: int, deadline: float, error: Callable[[], BaseException]) -> int:
        """Wait (FIFO) until a footprint of ``pages`` fits, then hold it; returns the pages held
        (``pages`` capped at the capacity: give them back with :meth:`leave`).

        Raises:
            BaseException: ``error()`` (a typed tierkv error) when ``deadline`` (loop time)
                passes first; CancelledError when cancelled. Nothing is held then.
        """
        got = self.enter_now(pages)
        if got is not None:
            return got
        pages = min(max(pages, 0), self.capacity)
        fut = asyncio.get_running_loop().create_future()
        waiter = _Waiter(pages, fut)
        self._queue.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except BaseException as exc:
            admitted = fut.done() and not fut.cancelled() and fut.exception() is None
            if admitted and isinstance(exc, TimeoutError):
                return pages  # admitted in the turn the deadline passed: room came in time
            if admitted:  # admitted as we were cancelled: give it back
                self.leave(pages)
            else:
                if waiter in self._queue:  # (a cancelled head may have been dropped already)
                    self._queue.remove(waiter)
                self._admit_heads()  # we may have blocked the requests behind us
            if isinstance(exc, TimeoutError):
                raise error() from None
            raise
        return pages

    def enter_now(self, pages: int) -> int | None:
        """:meth:`enter` with no wait: the pages held when the footprint fits now and nobody
        waits ahead of it, else None (nothing held, no place taken in the queue)."""
        pages = min(max(pages, 0), self.capacity)
        if not self._queue and self._fits(pages):
            self._take(pages)
            return pages
        return None

    def leave(self, pages: int) -> None:
        """An admitted lease ended: give its footprint back and admit who now fits."""
        self.committed -= pages
        self.active -= 1
        assert self.committed >= 0 and self.active >= 0, "admission left more than it took"
        self._admit_heads()

    def close(self, error: Callable[[], BaseException]) -> None:
        """Fail every waiting lease with ``error()`` (the store is closing); the admitted ones
        leave as they end."""
        q = self._queue
        while q:
            w = q.popleft()
            if not w.fut.done():
                w.fut.set_exception(error())

    def _take(self, pages: int) -> None:
        self.committed += pages
        self.active += 1

    def _admit_heads(self) -> None:
        q = self._queue
        while q:
            w = q[0]
            if w.fut.done():  # cancelled, its task not yet resumed: it takes nothing
                q.popleft()
                continue
            if not self._fits(w.pages):
                break
            q.popleft()
            self._take(w.pages)
            w.fut.set_result(None)

    def check(self) -> None:
        """Assert the invariants (for tests). Raises AssertionError."""
        assert self.committed >= 0, "negative footprint"
        assert self.active >= 0
        assert self.active > 0 or self.committed == 0, "footprint without a lease"
        head = self._queue[0] if self._queue else None
        assert head is None or head.fut.done() or not self._fits(head.pages), "a head fits"
