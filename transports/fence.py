"""Fencing peers' one-sided writes into our regions: who may write where, and when the writes
that were let in have ended.

An owner that hands out parts of a region to writers (the page server's reserved slots) must
not hand a part to someone else while a write into it can still land. Two pieces:

- a `WriteGuard` ``(agent, region id, offset, length) -> allowed``, asked before a peer's
  write is let into our memory, by the transports whose server CPU receives the bytes (tcp);
- `Transport.write_fence(agent)`: a future that is done once no write of ``agent`` (None: of
  anyone) that was let in before the call can still land, or None when the transport cannot
  tell (the bytes land without us: nixl/RDMA; then only the writer's own word ends its write).

`Landing` is the tcp server's bookkeeping of writes being received::

    header of a write ── guard(agent, segs)? ── no  -> "access" error, payload dropped
                                    │ yes
                                    v
                    started(conn, agent) ... payload lands ... ended(conn)  (or the link drops)
    write_fence(agent) = the ends of the writes of agent landing now (done at once if none)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Landing", "ReadGuard", "WriteGuard"]

#: (writer's agent name, region id, offset, length) -> whether its write may land there
WriteGuard = Callable[[str, int, int, int], bool]
#: (reader's agent name, region id, offset, length) -> whether it may read there (a server
#: that serves several tenants from one region: only the slots a reader's tenant holds)
ReadGuard = Callable[[str, int, int, int], bool]


class Landing:
    """Writes let in and still landing, one per connection at most (frames are sequential),
    and the fences waiting for them. Used from the event loop."""

    def __init__(self) -> None:
        self._now: dict[object, str] = {}  # connection -> agent of the write landing on it
        self._fences: list[tuple[set[object], asyncio.Future[None]]] = []

    def started(self, conn: object, agent: str) -> None:
        """A write on ``conn`` was let in; its payload is landing."""
        self._now[conn] = agent

    def ended(self, conn: object) -> None:
        """The write on ``conn`` landed, or ``conn`` dropped (nothing more lands from it)."""
        if self._now.pop(conn, None) is None:
            return
        keep: list[tuple[set[object], asyncio.Future[None]]] = []
        for waiting, fut in self._fences:
            waiting.discard(conn)
            if waiting or fut.done():
                if not fut.done():
                    keep.append((waiting, fut))
                continue
            fut.set_result(None)
        self._fences = keep

    def fence(self, agent: str | None) -> asyncio.Future[None]:
        """Done once the writes of ``agent`` (None: every agent) landing now have ended."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = {c for c, a in self._now.items() if agent is None or a == agent}
        if waiting:
            self._fences.append((waiting, fut))
        else:
            fut.set_result(None)
        return fut

    @property
    def landing(self) -> int:
        """Writes being received now."""
        return len(self._now)
