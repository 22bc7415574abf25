"""Cooperative yielding: a loop turn's budget of store work, so the loop stays responsive.

An asyncio loop runs every callback that is ready at the start of a turn before it looks at its
timers and sockets again. A thousand sequences whose tasks each run a whole lease step (pin,
append every layer, read, release) in one callback make a turn as long as all of those steps
together: a timer, a request handler or a heartbeat on the same loop waits that long (tens of
milliseconds at 32 concurrent leases). Like Tokio's cooperative budget, the store's async calls
*pause*: once the store work done in the current turn passes a budget, the calling task yields
to the loop and resumes in the next turn. The work is the same, spread over more, shorter turns;
a loop with little to do never pauses (the budget is per turn, not per call).

The turn boundary is seen from a callback the budget schedules when it starts counting: it runs
at the start of the next turn (before the tasks that paused in this one), and the next call
starts a new count.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["TurnBudget"]


class TurnBudget:
    """Store work allowed in one loop turn before a call pauses (yields once to the loop).

    Args:
        budget: seconds of work per turn; ``None`` never pauses.
    """

    __slots__ = ("_armed", "_start", "budget", "pauses")

    def __init__(self, budget: float | None = 0.002) -> None:
        self.budget = budget
        self._armed = False  # counting the current turn
        self._start = 0.0
        self.pauses = 0  # calls that yielded (a figure for stats)

    def spent(self) -> bool:
        """True when the work of this loop turn has passed the budget (the first call of a turn
        starts the count and is never spent). Must run on the loop."""
        if self.budget is None:
            return False
        now = time.perf_counter()
        if not self._armed:
            self._armed = True
            self._start = now
            asyncio.get_running_loop().call_soon(self._next_turn)
            return False
        return now - self._start > self.budget

    def _next_turn(self) -> None:
        self._armed = False

    async def pause(self) -> None:
        """Yield to the loop once when this turn's budget is spent; return at once otherwise."""
        if self.spent():
            self.pauses += 1
            await asyncio.sleep(0)
