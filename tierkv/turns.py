"""Cooperative yielding: a loop turn's budget of store work, so the loop stays responsive.

An asyncio loop runs every callback that is ready at the start of a turn before it looks at its
timers and sockets again. A thousand sequences whose tasks each run a whole lease step (pin,
append every layer, read, release) in one callback make a turn as long as all of those steps
together: a timer, a request handler or a heartbeat on the same loop waits that long (tens of
milliseconds at 32 concurrent leases). Like Tokio's cooperative budget, the store's async calls
*pause* once the store work charged in the current turn passes a budget: the caller waits in a
first-come, first-served queue, and each later turn lets as many waiters go on as fit the
budget at what the waiters let go before cost (a moving average). The work is the same,
spread over more, shorter turns; a loop with little to do never pauses (the budget is per
turn, not per call).

Only the store's own work is charged (each call charges the time it ran): a model's layers
computed between store calls on the same loop do not make the store pause.

Tasks let go in the same turn do not re-check the budget when they resume (they were admitted
to this turn), so the queue, not a re-check, bounds a turn: a thousand tasks that paused
together do not all run in the next one. The turn boundary is seen from a callback the budget
schedules when it starts counting: it runs at the start of the next turn.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["DEFAULT_BUDGET", "TurnBudget"]

_MAX_GRANT = 4096
DEFAULT_BUDGET = 0.0003  # seconds of store work per loop turn (KVStore's default)


class TurnBudget:
    """Store work allowed in one loop turn before a call pauses (waits its turn in a queue).

    Args:
        budget: seconds of work per turn; ``None`` never pauses.
    """

    __slots__ = (
        "_armed",
        "_cost",
        "_granted",
        "_out",
        "_ticking",
        "_used",
        "_waiting",
        "budget",
        "pauses",
    )

    def __init__(self, budget: float | None = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._armed = False  # counting the current turn
        self._used = 0.0  # store work charged in the current turn
        self._waiting: deque[asyncio.Future[None]] = deque()  # paused callers, first come first
        self._ticking = False  # a tick is scheduled for the next turn
        self._out = False  # the first caller to pause in a turn is yielding for one turn
        self._granted = 0  # waiters let go by the last tick
        # seconds of work one waiter let go costs (a moving average): the grant per turn is
        # the budget over it
        self._cost = (budget or DEFAULT_BUDGET) / 4
        self.pauses = 0  # calls that waited (a figure for stats)

    @property
    def waiting(self) -> int:
        """Callers paused now."""
        return len(self._waiting)

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of store work in this loop turn (the store's calls charge the time
        they ran; the caller's own work between them, a model's layers, is not counted).
        Outside a running loop (a synchronous caller), or without a budget, nothing is
        counted."""
        if self.budget is None:
            return
        if not self._armed:
            try:
                self._arm()
            except RuntimeError:  # no running loop: no turn to count in
                return
        self._used += seconds

    def spent(self) -> bool:
        """True when the store work charged in this loop turn has passed the budget. Must run
        on the loop."""
        if self.budget is None:
            return False
        if not self._armed:
            self._arm()
            return False
        return self._used > self.budget

    def _arm(self) -> None:
        self._armed = True
        self._used = 0.0
        asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._armed = False

    async def pause(self, always: bool = False) -> None:
        """Wait for a later turn when this turn's budget is spent or others wait already (first
        come, first served); return at once otherwise, or, with ``always``, after one plain
        yield to the loop. Cancelled while waiting, the caller leaves the queue."""
        if self.budget is None:
            if always:
                await asyncio.sleep(0)
            return
        if always and not self._waiting and not self.spent():
            await asyncio.sleep(0)
        if not self._waiting and not self.spent():
            return
        self.pauses += 1
        if not self._waiting and not self._out:
            # the first to pause in this turn yields for one turn only (a lone task, as a
            # single sequence's decode, pays one loop turn per budget of work, not the
            # queue's two); whoever pauses while it is out waits in the queue
            self._out = True
            try:
                await asyncio.sleep(0)
            finally:
                self._out = False
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting.append(fut)
        if not self._ticking:
            self._ticking = True
            loop.call_soon(self._tick)
        await fut  # (cancelled: the future is cancelled too, and the tick passes over it)

    def _tick(self) -> None:
        """Once per turn while callers wait: estimate what one waiter let go costs (from the
        work of this turn so far, which the waiters let go last time began), and let as many
        go on as fit the budget (they run in the next turn)."""
        self._ticking = False
        budget = self.budget
        if self._armed and self._granted:  # what the waiters let go last time charged
            each = self._used / self._granted
            self._cost = 0.5 * self._cost + 0.5 * each
        if budget is None:  # turned off while callers waited: they all go on
            n = len(self._waiting)
        else:
            n = max(1, min(_MAX_GRANT, int(budget / max(self._cost, 1e-7))))
        waiting, granted = self._waiting, 0
        while granted < n and waiting:
            fut = waiting.popleft()
            if not fut.done():  # a cancelled waiter is passed over
                fut.set_result(None)
                granted += 1
        self._granted = granted
        if waiting or granted:  # (after a grant: the next tick measures what it cost)
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._tick)
