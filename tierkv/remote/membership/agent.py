"""`DirectoryAgent`: one page server's presence in the cluster directory (redis_directory.py).

::

    start:  connect (bad url / refused auth: raise) -> register (address held by a live node:
            NodeIdTakenError, after waiting once for a restarted node's former self to lapse)
    tasks:  publisher: woken by `changed` (then `linger` lets a burst collect), else every
              ttl / 3: publish what changed (held() - published, published - held())
            keepalive: refresh the registration every ttl / 3 (a long publish never delays
              it); found lapsed -> the publisher registers again
            sweeper: every `sweep_every`, remove dead nodes' entries
    Redis fails / is slow: counted, a warning (rate limited), retried with backoff; the keys
            of a call that failed are *uncertain* (it may or may not have landed): the next
            call adds those still held and withdraws the others. When Redis comes back
            without our registration (restarted empty, or we lapsed), the refresh says so:
            the node registers again under a new number and publishes its full set
    aclose: leave (our entries stop being answered at once), close

Only the agent's task touches ``published``, ``uncertain`` and ``number``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from redis.exceptions import RedisError

from tierkv.failures import FailureLog
from tierkv.remote.errors import DirectoryError, NodeIdTakenError
from tierkv.remote.membership.redis_directory import PUBLISH_BATCH, RedisDirectory

__all__ = ["DirectoryAgent"]

_FAILURES = (RedisError, OSError, TimeoutError, DirectoryError)


class DirectoryAgent:
    """Registers ``address`` in ``directory`` and keeps what ``held()`` returns published.

    Args:
        directory: the directory (not yet connected: `start` connects it).
        address: our address as clients reach us (the node id).
        held: the content pages we hold now.
        linger: seconds a burst of changes collects before it is published.
        sweep_every: seconds between tries to sweep dead nodes' entries (default: the larger
            of 4 ttl and 30 s: a sweep walks every bucket).
        backoff_cap: the longest wait between tries while Redis fails.
    """

    def __init__(
        self,
        directory: RedisDirectory,
        address: str,
        held: Callable[[], set[bytes]],
        *,
        linger: float = 0.02,
        sweep_every: float | None = None,
        backoff_cap: float = 2.0,
    ) -> None:
        self.directory, self.address, self._held = directory, address, held
        self.linger, self.backoff_cap = linger, backoff_cap
        self.sweep_every = max(4 * directory.ttl, 30.0) if sweep_every is None else sweep_every
        self.number = 0  # our registration (0: none now)
        self.published: set[bytes] = set()
        self.uncertain: set[bytes] = set()  # keys of failed calls: state in Redis unknown
        self.errors = 0  # failed calls to Redis
        self.registrations = 0
        self.swept = 0  # dead nodes' entries removed by our sweeps
        self._prev = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lapsed = False  # the keepalive found our registration gone
        # set before the tasks are cancelled: a loop whose cancellation a library call
        # swallowed (redis-py turning it into a connection error, caught below) ends at its
        # next turn instead of refreshing a registration that halt() meant to let lapse
        self._closing = False
        self._failures = FailureLog("tierkv.remote.directory", tracebacks=False)

    async def start(self) -> DirectoryAgent:
        """Connect and register. Raises DirectoryURLError / DirectoryAuthError (bad
        configuration), NodeIdTakenError; an unreachable Redis is only warned about (the
        agent keeps trying: serving pages does not need the directory)."""
        try:
            await self.directory.connect()
            await self._register()
        except NodeIdTakenError:
            raise
        except _FAILURES as exc:
            if type(exc) is not DirectoryError and isinstance(exc, DirectoryError):
                raise  # bad url, refused auth: the operator's to fix
            self._failed("start", exc)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(f()) for f in (self._run, self._keepalive, self._sweeper)]
        return self

    async def halt(self) -> None:
        """Stop without leaving and close the client: what a crash leaves in Redis (our
        registration lapses within ttl). For tests and benchmarks; `aclose` leaves."""
        await self._stop()
        await self.directory.aclose()

    async def _stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        self._closing = True
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a loop whose cancellation was swallowed ends at its next turn
            await asyncio.wait(tasks, timeout=self.directory.timeout)

    async def aclose(self) -> None:
        """Stop; leave the directory (bounded by its timeout) and close it."""
        await self._stop()
        if self.number:
            with contextlib.suppress(*_FAILURES):
                await asyncio.wait_for(
                    self.directory.leave(self.number, self.address), self.directory.timeout
                )
            self.number = 0
        await self.directory.aclose()

    def changed(self) -> None:
        """Our holdings changed: published within ``linger`` (when Redis answers)."""
        self._wake.set()

    @property
    def registered(self) -> bool:
        """Whether we are registered now (as far as we know)."""
        return self.number != 0

    def stats(self) -> dict[str, int]:
        """The agent's counters."""
        return {
            "directory_registered": int(self.registered),
            "directory_number": self.number,
            "directory_published": len(self.published),
            "directory_errors_total": self.errors,
            "directory_registrations_total": self.registrations,
            "directory_swept_total": self.swept,
            **self.directory.stats(),
        }

    async def _register(self) -> None:
        self.number = await self.directory.register(self.address, self._prev)
        self._prev = self.number
        self.published, self.uncertain = set(), set()
        self.registrations += 1

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        self._failures.report(f"directory {what}", exc, tier="directory")

    async def _run(self) -> None:
        """Publish what changed; register (again) when we have no live registration."""
        backoff = 0.05
        while not self._closing:
            try:
                if not self.number or self._lapsed:
                    self._lapsed = False
                    await self._register()
                await self._publish()
                backoff = 0.05
            except _FAILURES as exc:
                self._failed("sync", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_cap)
                continue
            # woken by a change, else a scan every ttl/3 (additions by local computation)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.directory.ttl / 3)
                await asyncio.sleep(self.linger)  # let a burst of changes collect
            self._wake.clear()

    async def _keepalive(self) -> None:
        """Refresh every ttl/3, apart from publishing (a long publish never delays it); a
        registration found lapsed wakes the publisher to register again."""
        while not self._closing:
            await asyncio.sleep(self.directory.ttl / 3)
            number = self.number
            if not number or self._lapsed:
                continue
            try:
                lapsed = not await self.directory.refresh(number, self.address)
                if lapsed and number == self.number:
                    self._lapsed = True
                    self._wake.set()
            except _FAILURES as exc:
                self._failed("refresh", exc)

    async def _sweeper(self) -> None:
        """Every ``sweep_every``: remove dead nodes' entries (one node at a time does)."""
        while not self._closing:
            await asyncio.sleep(self.sweep_every)
            try:
                self.swept += await self.directory.sweep()
            except _FAILURES as exc:
                self._failed("sweep", exc)

    async def _publish(self) -> None:
        now = self._held()
        add = list((now - self.published) | (now & self.uncertain))
        drop = list((self.published - now) | (self.uncertain - now))
        if not add and not drop:
            return
        timeout = self.directory.timeout * (1 + (len(add) + len(drop)) // PUBLISH_BATCH)
        try:
            await asyncio.wait_for(self.directory.publish(self.number, add, drop), timeout)
        except BaseException:
            self.uncertain.update(add, drop)  # landed or not: the next call sets them right
            raise
        self.published, self.uncertain = now, set()
