"""How a :class:`~tierkv.integrations.hf.TieredCache` reaches its store: which thread runs the
store's coroutines.

A store the cache opens itself runs on a private event loop driven in the caller's thread
(:class:`LocalStore`), and nothing else runs Python meanwhile: a step is entered, its layers
served and left with no loop run where nothing waits (:meth:`LocalStore.enter`,
:meth:`LocalStore.turn` for a few passes where a task was started, :meth:`LocalStore.leave`),
else with one ``run_until_complete``. A shared :class:`~tierkv.sync.SyncKVStore` (or a
store opened where an event loop already runs, as in async code) runs on its own loop thread
(:class:`ThreadStore`): every ``update()`` hops there and back::

    LocalStore   model thread: forward ... update: [lease, append, gather, prefetch] ... forward
    ThreadStore  model thread: forward ... update --hop-->  store thread: [lease ...]
                                           <--result--

Measured on SmolLM2-135M on two cores (``tierkv demo``): the hop and the GIL shared with a
busy store thread cost more CPU time per token than the store's own work, so a store nobody
else uses stays on the caller's thread. Copies still run on the runtime's stream threads; the
prefetch of the next layer is submitted before ``update()`` returns, and its completion is
taken in at the next ``update()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tierkv.errors import StoreClosedError, StoreTimeoutError, TierKVError
from tierkv.runtime import new_event_loop
from tierkv.spec import KVSpec
from tierkv.step import StepPlan
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore

T = TypeVar("T")


class LoopInUseError(TierKVError, RuntimeError):
    """A cache with a private store was used from a thread whose event loop is running."""


async def _bounded(coro: Coroutine[Any, Any, T], limit: float) -> T:
    try:
        async with asyncio.timeout(limit):
            return await coro
    except TimeoutError as exc:
        if isinstance(exc, TierKVError):  # the store's own (already mapped) timeout
            raise
        raise StoreTimeoutError(f"no answer from the store within {limit:.3g} s") from exc


class LocalStore:
    """A :class:`KVStore` on a private event loop that the calling thread drives.

    One thread at a time (as with any transformers cache). Arguments as for KVStore, except
    that ``turn_budget`` defaults to None (nothing else runs on the loop). Raises what KVStore
    raises (tierkv errors only).
    """

    def __init__(self, spec: KVSpec, **kwargs: Any) -> None:
        # the loop is this store's alone: no other task to yield to, so no turn budget (each
        # pause would cost the model's thread a loop turn) unless the caller asks for one
        kwargs.setdefault("turn_budget", None)
        self.store = KVStore(spec, **kwargs)  # checks every argument first
        # asyncio's loop: uvloop's run_until_complete opens and closes a signal socketpair on
        # every call in the main thread (0.1-0.5 ms, once per layer and token here)
        self._loop = new_event_loop(use_uvloop=False)
        self._closed = False
        try:
            self.run(self.store.open())
        except BaseException:
            self._closed = True
            self._loop.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the store's loop in this thread; at most twice the store's timeout.

        Raises StoreClosedError after :meth:`close`, LoopInUseError when this thread already
        runs an event loop (use a shared SyncKVStore there), StoreTimeoutError past the bound.
        """
        if self._closed:
            coro.close()
            raise StoreClosedError("store is closed")
        if _loop_running():
            coro.close()
            raise LoopInUseError(
                "a TieredCache that opened its own store runs it in the calling thread, which "
                "here already runs an event loop: call generate() in another thread "
                "(asyncio.to_thread) or pass TieredCache(store=SyncKVStore(...))"
            )
        return self._loop.run_until_complete(_bounded(coro, self.store.timeout * 2))

    def turn(self, done: Callable[[], bool] | None = None, turns: int = 8) -> None:
        """Run the store's loop in this thread for at most ``turns`` passes over its ready
        callbacks, stopping early once ``done()`` is true; never waits (a pass that finds
        nothing ready polls for I/O with a zero timeout). A step group's task started just
        before takes its steps: its loads are submitted, and where its copies ran inline
        (cpu backend) it completes here, so its first layer needs no loop run.

        Raises StoreClosedError after :meth:`close`, LoopInUseError as :meth:`run` does."""
        self._check_thread()
        loop = self._loop
        loop.call_soon(_passes, loop, turns, done)
        loop.run_forever()

    def enter(self, plan: StepPlan) -> bool:
        """Enter ``plan`` with no loop run where its room is there at once
        (:meth:`StepPlan.enter_now` on this store's loop); False, nothing held, otherwise.
        Raises StoreClosedError after :meth:`close`, LoopInUseError as :meth:`run` does, and
        what the entry raises."""
        self._check_thread()
        return plan.enter_now(self._loop)

    def _check_thread(self) -> None:
        """Raise StoreClosedError after :meth:`close`, LoopInUseError where this thread runs
        an event loop."""
        if self._closed:
            raise StoreClosedError("store is closed")
        if _loop_running():
            raise LoopInUseError("this thread already runs an event loop")

    def leave(self, plan: StepPlan) -> bool:
        """End ``plan`` (a step that raised nothing) and the store's step with no loop run
        where nothing of the plan is under way (:meth:`StepPlan.exit_now`, then
        :meth:`KVStore.step`); the loop runs a few passes, never waiting, only where the exit
        started something (the next step's prefetch, a write-behind, a compression: tasks
        of the store's own loop), so that their copies are submitted, and the inline ones
        end, before the caller computes (a write-behind left pending keeps its pages
        pinned). False, nothing done, otherwise (run ``plan.__aexit__`` and
        ``store.step()``). Raises StoreClosedError after :meth:`close`, LoopInUseError as
        :meth:`run` does, and what the exit raises."""
        self._check_thread()
        if not plan.exit_now():
            return False
        store = self.store
        store.step()
        started, plan.starting = plan.starting, None
        if started is not None or store.background:
            self.turn(lambda: (started is None or started.done()) and not store.background)
        return True

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the store (the store is single-threaded: this thread owns it)."""
        if self._closed:
            raise StoreClosedError("store is closed")
        return fn()

    def close(self) -> None:
        """Close the store and its loop. Idempotent."""
        if self._closed:
            return
        try:
            self.run(self.store.close())
        finally:
            self._closed = True
            self._loop.close()


def _passes(loop: asyncio.AbstractEventLoop, n: int, done: Callable[[], bool] | None) -> None:
    """Stop ``loop`` after ``n`` passes over its ready callbacks, or once ``done()``."""
    if n <= 1 or (done is not None and done()):
        loop.stop()
    else:
        loop.call_soon(_passes, loop, n - 1, done)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class ThreadStore:
    """A shared :class:`SyncKVStore`: coroutines hop to its loop thread and back."""

    def __init__(self, sync: SyncKVStore) -> None:
        self.sync = sync
        self.store = sync.store

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the store's loop thread and wait (:meth:`SyncKVStore.run`)."""
        return self.sync.run(coro)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the store's loop thread (:meth:`SyncKVStore.call`)."""
        return self.sync.call(fn)

    def close(self) -> None:
        """Close the shared store (only its opener does)."""
        self.sync.close()


Driver = LocalStore | ThreadStore


def open_store(spec: KVSpec, **kwargs: Any) -> Driver:
    """A new store for one cache: a :class:`LocalStore`, or a :class:`ThreadStore` over a new
    SyncKVStore when this thread already runs an event loop (its ``run_until_complete`` would
    fail there). Arguments and errors as for KVStore."""
    if _loop_running():
        return ThreadStore(SyncKVStore(spec, **kwargs))
    return LocalStore(spec, **kwargs)


class StoreOwner:
    """A store a cache opened, shared with its deep copies: closed when the last one closes."""

    def __init__(self, store: Driver) -> None:
        self.store = store
        self.refs = 1

    def drop(self) -> None:
        """One user fewer; the last one closes the store."""
        self.refs -= 1
        if self.refs == 0:
            self.store.close()
