"""A blocking facade over :class:`~tierkv.store.KVStore` for callers without an event loop.

The store runs on its own event loop in a background thread; every call hops onto that loop
(so the store stays single-threaded) and waits at most the store's timeout::

    with tierkv.SyncKVStore(spec, device_bytes=..., host_bytes=...) as store:
        store.add_sequence("r1", prompt)
        with store.lease(["r1"]) as lease:
            lease.append("r1", 0, k, v)
            k_all, v_all = lease.kv("r1", 0)
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from tierkv.boundary import map_error
from tierkv.errors import InvalidTypeError, StoreClosedError, StoreTimeoutError
from tierkv.lease import Lease
from tierkv.runtime import new_event_loop
from tierkv.spec import KVSpec
from tierkv.store import KVStore

T = TypeVar("T")


class SyncLease:
    """The blocking twin of :class:`~tierkv.lease.Lease`."""

    def __init__(self, owner: SyncKVStore, lease: Lease) -> None:
        self._owner, self._lease = owner, lease

    def append(self, seq_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """See :meth:`tierkv.lease.Lease.append`."""
        self._owner.run(self._lease.append(seq_id, layer, k, v))

    def kv(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`tierkv.lease.Lease.kv`."""
        return self._owner.call(lambda: self._lease.kv(seq_id, layer))


class SyncKVStore:
    """A :class:`KVStore` driven from ordinary (blocking) code. Arguments as for KVStore.

    Raises what KVStore raises (tierkv errors only), plus StoreTimeoutError when a call gets no
    answer from the store's loop within twice the store's timeout. Arguments are checked
    before the loop thread starts.
    """

    def __init__(self, spec: KVSpec, **kwargs: Any) -> None:
        try:
            inspect.signature(KVStore).bind(spec, **kwargs)
        except TypeError as exc:
            raise InvalidTypeError(f"SyncKVStore: {exc} (arguments as for KVStore)") from None
        store = KVStore(spec, **kwargs)  # checks every argument before a thread starts
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tierkv-store", daemon=True
        )
        self._thread.start()
        self.store = store
        self._closed = False
        try:
            self.run(self.store.open())
        except BaseException:
            self._stop()
            raise

    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the store's loop thread and wait for it (at most twice the store's
        timeout). Raises StoreClosedError after close, StoreTimeoutError when the loop does not
        answer, InvalidTypeError for something that cannot be awaited, and the store's errors
        mapped to the tierkv tree."""
        if not inspect.isawaitable(coro):  # (an int was a TypeError on the loop thread)
            raise InvalidTypeError(f"run takes a coroutine, got {type(coro).__name__}")
        if self._closed:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise StoreClosedError("store is closed")

        async def wrap() -> T:
            return await coro

        fut = asyncio.run_coroutine_threadsafe(wrap(), self._loop)
        limit = self.store.timeout * 2
        try:
            return fut.result(limit)
        except TimeoutError as exc:
            if fut.done():  # the store's own (already mapped) timeout
                raise
            fut.cancel()
            msg = f"no answer from the store's loop within {limit:.3g} s"
            raise StoreTimeoutError(msg) from exc
        except Exception as exc:
            mapped = map_error(exc)
            if mapped is None:
                raise
            raise mapped from exc

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the store's loop thread (for the store's synchronous methods), as
        :meth:`run`."""
        if self._closed:
            raise StoreClosedError("store is closed")

        async def wrap() -> T:
            return fn()

        return self.run(wrap())

    def lookup(self, tokens: Sequence[int], *, salt: bytes | str | None = None) -> int:
        """See :meth:`KVStore.lookup`."""
        return self.call(lambda: self.store.lookup(tokens, salt=salt))

    def add_sequence(self, seq_id: str, tokens: Sequence[int], **options: Any) -> int:
        """See :meth:`KVStore.add_sequence` (``options``: its ``salt=``, ``tenant=``)."""
        return self.run(self.store.add_sequence(seq_id, tokens, **options))

    def add_tokens(self, seq_id: str, tokens: Sequence[int]) -> None:
        """See :meth:`KVStore.add_tokens`."""
        self.call(lambda: self.store.add_tokens(seq_id, tokens))

    def release(self, seq_id: str) -> None:
        """See :meth:`KVStore.release`."""
        self.run(self.store.release(seq_id))

    def prefetch(self, seq_ids: Sequence[str], layers: Sequence[int] | None = None) -> int:
        """Prefetch and wait (see :meth:`KVStore.prefetch`)."""
        return self.run(self.store.prefetch(seq_ids, layers, wait=True))

    def schedule(self, steps: Sequence[Sequence[str]]) -> None:
        """See :meth:`KVStore.schedule`."""
        self.call(lambda: self.store.schedule(steps))

    def step(self) -> None:
        """See :meth:`KVStore.step`."""
        self.call(self.store.step)

    def stats(self) -> dict[str, Any]:
        """See :meth:`KVStore.stats`."""
        return self.call(self.store.stats)

    @contextmanager
    def lease(
        self, seq_ids: Sequence[str], layers: Sequence[int] | None = None
    ) -> Iterator[SyncLease]:
        """Pin pages on the device for the ``with`` block (see :meth:`KVStore.lease`)."""
        lease = self.call(lambda: self.store.lease(seq_ids, layers))
        self.run(lease.__aenter__())
        try:
            yield SyncLease(self, lease)
        finally:
            self.run(lease.__aexit__(None, None, None))

    def close(self) -> None:
        """Close the store and stop its thread. Idempotent."""
        if self._closed:
            return
        try:
            self.run(self.store.close())
        finally:
            self._closed = True
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.store.timeout if hasattr(self, "store") else 5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
