"""The sequence ids whose :meth:`~tierkv.store.KVStore.add_sequence` or
:meth:`~tierkv.store.KVStore.release` is in flight (begun, not returned), so that the calls of
one id take turns:

- ``add_sequence(id)`` while a release of ``id`` is in flight waits for it to return, then
  adds (the release happened first);
- ``release(id)`` while an ``add_sequence(id)`` is in flight waits for it to return, then
  releases what it added (or raises SequenceError when the add failed);
- a second ``add_sequence(id)`` while one is in flight raises SequenceError at once (the id
  is taken), a second ``release(id)`` while one is in flight too (the id is gone).

Every wait is woken by the call it waits for ending (a future set in its ``finally``) and
bounded by the store's timeout: StoreTimeoutError then, with nothing changed. One per store.
"""

from __future__ import annotations

import asyncio

from tierkv.errors import SequenceError, StoreTimeoutError

__all__ = ["ADD", "RELEASE", "InFlight"]

ADD = "add_sequence"
RELEASE = "release"


class InFlight:
    """Per sequence id, the add or release of it in flight and a future set when it ends."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[str, tuple[str, asyncio.Future[None]]] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._calls

    async def turn(self, seq_id: str, call: str, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no call of ``seq_id`` is in flight, then
        record ``call`` of it (the caller must :meth:`end` it). Raises SequenceError at once
        when the same call is in flight (an id added twice, released twice), StoreTimeoutError
        when the other call outlasts the timeout (nothing recorded then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (busy := self._calls.get(seq_id)) is not None:
            other, done = busy
            if other == call:
                what = "is being added" if call == ADD else "is being released"
                raise SequenceError(f"sequence {seq_id!r} {what} already")
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(done)
            except TimeoutError:
                if done.done():  # (ended at the very deadline)
                    continue
                raise StoreTimeoutError(
                    f"{call}({seq_id!r}) waited {timeout:g} s for the {other} of that id in "
                    "flight to return (nothing changed)"
                ) from None
        self._calls[seq_id] = (call, loop.create_future())

    def end(self, seq_id: str) -> None:
        """The call of ``seq_id`` recorded by :meth:`turn` returned (or failed): its waiters
        go on."""
        _, done = self._calls.pop(seq_id)
        done.set_result(None)
