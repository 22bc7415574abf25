"""The prefault thread of the tier core: the device arena's memory committed ahead of use.

New pages are written on the loop's thread (appends), and a first write to an uncommitted huge
page stalls it ~1-5 ms (see :meth:`~tierkv.runtime.Arena.prefault`). The page table's free list
hands out the lowest slots first, so the arena fills from slot 0 up: :class:`Prefaulter` keeps
the slots a chunk ahead of the highest one in use committed, from one daemon thread of its own
(started with the tier core: starting one on the loop's thread while it runs cost tens of ms),
fed by a queue, so asking costs the loop a queue put.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from tierkv.runtime import Arena

__all__ = ["PREFAULT_BYTES", "Prefaulter"]

PREFAULT_BYTES = 8 << 20  # device memory committed ahead of use, per prefault


class Prefaulter:
    """One daemon thread that commits an arena's memory ahead of use (:meth:`Arena.prefault`,
    which releases the GIL). The first two chunks are committed at once, on the calling thread,
    before the first append needs them (a background prefault racing the first appends left
    them faulting on the loop)."""

    def __init__(self, arena: Arena, chunk_bytes: int = PREFAULT_BYTES) -> None:
        self._arena = arena
        self._chunk = max(1, chunk_bytes // arena.slot_bytes)
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tierkv-prefault", daemon=True)
        self._thread.start()
        # slots below this are committed, or being so by the thread
        self._warm = min(arena.num_slots, 2 * self._chunk)
        arena.prefault(0, self._warm)

    def ahead(self, slots: Sequence[int]) -> None:
        """Slots now in use: keep the arena committed two chunks past the highest, in the
        background (nothing when it is far enough ahead already, or after close)."""
        arena = self._arena
        top = max(slots, default=-1) + 1
        if top + self._chunk <= self._warm or self._warm >= arena.num_slots:
            return
        first = self._warm
        # two chunks ahead: the thread has a chunk's worth of appends to commit the next one
        self._warm = min(arena.num_slots, max(first, top) + 2 * self._chunk)
        if not self._closed:
            self._queue.put((first, self._warm - first))

    def close(self) -> None:
        """Let the thread end once what was asked is done. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self._arena.prefault(*job)
