"""Event-woken waits with a deadline: the only way the store waits for tier state to change.

Nothing in the store polls. A waiter for "room on the device" or "this page landed" awaits
:meth:`Changes.wait`, which resolves the next time the owner of the tier state calls
:meth:`Changes.notify` (a copy finished, a pin went, a page left), and raises the caller's typed
error once the deadline passes. The waiter then looks at the state again: a change is a hint to
re-check, never a promise that the wanted thing happened::

    deadline = changes.deadline(timeout)
    while not ready():
        await changes.wait(deadline, lambda: TierFullError("..."))

One future serves every waiter of one generation, so a notify costs O(1) whatever the number of
waiters, and a cancelled waiter (its await is shielded) never cancels the others' future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    """A "something changed" condition of one event loop, with deadlines in loop time."""

    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None
        self.notified = 0  # how many notifies happened (a cheap progress counter for tests)

    def future(self) -> asyncio.Future[None]:
        """A future resolved by the next :meth:`notify` (shared by every current waiter)."""
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def notify(self) -> None:
        """Wake every waiter: the state they wait on may have changed."""
        self.notified += 1
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    @staticmethod
    def deadline(timeout: float) -> float:
        """The loop time ``timeout`` seconds from now."""
        return asyncio.get_running_loop().time() + timeout

    async def wait(self, deadline: float, error: Callable[[], BaseException]) -> None:
        """Wait for the next :meth:`notify`, at most until ``deadline`` (loop time).

        Raises:
            BaseException: ``error()`` (a typed tierkv error) when the deadline passes first.
        """
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline:
            raise error()
        fut = self.future()
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(fut)
        except TimeoutError:
            if fut.done():  # notified at the very deadline: not a timeout
                return
            raise error() from None
