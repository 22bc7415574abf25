"""Waiting for the tier core's own transfer jobs: a slot is free again only once its job ended.

The tier core owns every copy it starts (a load, a write-back, an encode, a remote read): its
bookkeeping (commit, roll back, unpin) runs when the job has really ended, never when a waiter
gave up. So the core does not wait on a job with a timeout: :func:`job_done` resolves from the
job's completion callback, however long that takes (a copy that never ends keeps its slots, as
it must: its bytes may still land). Callers bound their own waits (:func:`within`), and a
caller that gives up leaves the job to the core's task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tierkv.runtime import TransferHandle, TransferStats

__all__ = ["job_done", "when_done", "within"]

T = TypeVar("T")


async def job_done(handle: TransferHandle) -> TransferStats:
    """Wait, with no deadline of its own, until ``handle`` has ended (woken by its completion,
    never polled). Returns its statistics; raises what it failed with."""
    if not handle.done():
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake(_: TransferHandle) -> None:  # on the thread that completed the job
            loop.call_soon_threadsafe(lambda: None if fut.done() else fut.set_result(None))

        handle.add_done_callback(wake)
        await fut
    exc = handle.exception()
    if exc is not None:
        raise exc
    return handle.stats


def when_done(handle: TransferHandle, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the loop once ``handle`` no longer touches its slots (now if it is done):
    the rollback of a job whose caller is gone belongs to the tier core, not to that caller.
    One completion callback, no task: nothing is kept alive while the job runs but it."""
    if handle.done():
        fn()
        return
    loop = asyncio.get_running_loop()

    def wake(_: TransferHandle) -> None:  # on the thread that completed the job
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to roll back
            loop.call_soon_threadsafe(fn)

    handle.add_done_callback(wake)


async def within(deadline: float, aw: Awaitable[T], error: Callable[[], BaseException]) -> T:
    """Await ``aw`` until ``deadline`` (loop time); past it raise ``error()`` (``aw``, shielded
    by the caller when it must go on, is cancelled otherwise)."""
    try:
        async with asyncio.timeout_at(deadline):
            return await aw
    except TimeoutError:
        raise error() from None
