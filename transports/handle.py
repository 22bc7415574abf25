"""The handle a posted read or write returns: awaitable, bounded, cancellable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from .errors import TransferTimeoutError

__all__ = ["BatchHandle"]


class BatchHandle:
    """Completion of one posted batch.

    ``await handle`` waits at most the transport's timeout; ``await handle.wait(t)`` at most `t`
    seconds. Either raises the transfer's error (a `TransportError`) or `TransferTimeoutError`.
    A wait that times out or is cancelled does not stop the transfer (it stays bounded by its own
    deadline); `cancel()` does, and once it returns no further byte lands in local memory.
    """

    __slots__ = (
        "_abort_hooks",
        "_task",
        "_timeout",
        "expired",
        "nbytes",
        "num_ops",
        "sums",
        "want_sums",
    )

    def __init__(self, *, timeout: float, nbytes: int, num_ops: int) -> None:
        self._task: asyncio.Future[None] | None = None
        self._timeout = timeout
        self._abort_hooks: list[Callable[[], None]] = []
        self.expired = False
        self.nbytes = nbytes
        self.num_ops = num_ops
        #: a read posted with ``checksums=True``: the CRC-32C of each op's bytes as they landed
        #: in local memory (set once the transfer succeeded; None before, or when not asked)
        self.want_sums = False
        self.sums: list[int] | None = None

    def _start(self, task: asyncio.Future[None]) -> None:
        self._task = task
        timer = task.get_loop().call_later(self._timeout, self._expire)
        task.add_done_callback(lambda _: timer.cancel())

    def on_abort(self, hook: Callable[[], None]) -> None:
        """For backends: `hook()` runs synchronously when the transfer is cancelled or expires,
        and must stop every further byte from landing (e.g. abort the connection)."""
        self._abort_hooks.append(hook)

    def _expire(self) -> None:
        if not self.task.done():
            self.expired = True
            self.cancel()

    @property
    def task(self) -> asyncio.Future[None]:
        assert self._task is not None, "handle not started"
        return self._task

    def done(self) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self.task.done()

    def exception(self) -> BaseException | None:
        """The transfer's error once done (None on success). Raises InvalidStateError before."""
        if self.task.cancelled():
            return asyncio.CancelledError()
        return self.task.exception()

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for completion, at most `timeout` seconds (default: the transport's timeout).

        Raises the transfer's `TransportError`, or `TransferTimeoutError` when time runs out.
        """
        limit = self._timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(asyncio.shield(self.task), limit)
        except TimeoutError:
            if self.task.done():  # settled as time ran out: its own result or error wins
                self.task.result()
                return
            raise TransferTimeoutError(
                f"transfer of {self.nbytes} bytes not done after {limit:g} s"
            ) from None

    def cancel(self) -> bool:
        """Stop the transfer. Bytes already copied stay; none land after this returns."""
        if self.task.done():
            return False
        hooks, self._abort_hooks = self._abort_hooks, []
        for hook in hooks:
            hook()
        return self.task.cancel()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<BatchHandle {self.num_ops} ops, {self.nbytes} bytes, {state}>"
