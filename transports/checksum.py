"""Payload checksums for the tcp transport: the algorithms, incremental use, a worker thread.

Two algorithms, named on the wire (the handshake agrees on one per connection):

- ``crc32c`` (Castagnoli): the extension built at install time (transports/_crc32c.c: SSE4.2
  crc32 lanes plus a VPCLMULQDQ-folded lane; ~10x zlib here), else the ``crc32c`` package when
  installed (crc32c_native.py picks). Preferred wherever one of them is available.
- ``crc32``: ``zlib.crc32`` (~2 GB/s on one core); always available, the fallback wherever
  neither is (no compiler at install time, a CPU without SSE4.2), and what version-1 peers use.

Both are CRCs, so a checksum fed in pieces equals the checksum of the whole (`Incremental`), and
both release the GIL on large buffers.

`ChecksumThread` computes checksums of large payloads in a worker thread (both algorithms
release the GIL), so that the event loop keeps the socket busy meanwhile: on a multi-core host
the checksum then costs little more than the last chunk's share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .crc32c_native import crc32c, native_crc32c
from .errors import InvalidInputError

__all__ = [
    "INLINE_BYTES",
    "Checksum",
    "ChecksumThread",
    "Incremental",
    "Update",
    "algorithms",
    "checksum_function",
    "crc32c",
    "native_crc32c",
    "spare_cores",
    "update_function",
]

#: Payloads smaller than this are checksummed on the calling thread (a hand-off costs more).
INLINE_BYTES = 256 << 10

#: A checksum over the concatenation of some buffers.
Checksum = Callable[[Sequence[memoryview]], int]
#: `update(data, crc)`: the checksum of everything so far followed by `data`.
Update = Callable[[Any, int], int]


def _crc32c_views(views: Sequence[memoryview]) -> int:
    fn = native_crc32c()
    if fn is None:
        return crc32c(b"")  # raises the explanation
    crc = 0
    for v in views:
        crc = fn(v, crc)
    return crc


def _crc32_views(views: Sequence[memoryview]) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def update_function(name: str) -> Update:
    """The incremental form of algorithm `name`. Raises ValueError as `checksum_function`."""
    if name not in algorithms():
        raise InvalidInputError(f"checksum {name!r} is not available here (have {algorithms()})")
    fn = native_crc32c() if name == "crc32c" else None
    return zlib.crc32 if fn is None else fn


class Incremental:
    """A checksum fed piece by piece (say, as a payload lands), computed in runs of at least
    `batch` bytes (fewer calls, and each run is still in cache)."""

    __slots__ = ("_batch", "_fn", "_held", "_run", "crc")

    def __init__(self, fn: Update, batch: int = 128 << 10) -> None:
        self._fn, self._batch = fn, batch
        self._run: list[memoryview] = []
        self._held = 0
        self.crc = 0

    def add(self, piece: memoryview) -> None:
        """Account for `piece` (the next bytes of the payload)."""
        self._run.append(piece)
        self._held += len(piece)
        if self._held >= self._batch:
            self._flush()

    def finish(self) -> int:
        """The checksum of everything added."""
        self._flush()
        return self.crc

    def _flush(self) -> None:
        crc, fn = self.crc, self._fn
        for v in self._run:
            crc = fn(v, crc)
        self.crc, self._run, self._held = crc, [], 0


def algorithms() -> tuple[str, ...]:
    """The checksum algorithms this process can compute, most preferred first."""
    return ("crc32c", "crc32") if native_crc32c() is not None else ("crc32",)


def checksum_function(name: str) -> Checksum:
    """The function computing algorithm `name` over a list of views. Raises ValueError when
    `name` is not one of `algorithms()`."""
    if name not in algorithms():
        raise InvalidInputError(f"checksum {name!r} is not available here (have {algorithms()})")
    return _crc32c_views if name == "crc32c" else _crc32_views


class ChecksumThread:
    """One worker thread that computes checksums in submission order, off the event loop.

    Started on first use; `close()` stops it (later requests are then computed inline).
    `enabled=False` computes everything inline: on a host without a spare core the hand-off
    only adds context switches (measured slower on 2 busy cores).
    """

    def __init__(self, enabled: bool = True) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._closed = not enabled

    def compute(self, fn: Checksum, views: Sequence[memoryview]) -> asyncio.Future[int]:
        """A future (of the running loop) resolving to `fn(views)`: computed at once for small
        payloads, in the worker thread otherwise. Exceptions of `fn` land in the future."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[int] = loop.create_future()
        if self._closed or sum(len(v) for v in views) < INLINE_BYTES:
            try:
                out.set_result(fn(views))
            except Exception as exc:
                out.set_exception(exc)
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-checksum")

        def back(done: Future[int]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, done, out)

        self._pool.submit(fn, views).add_done_callback(back)
        return out

    def close(self) -> None:
        """Stop the worker; a checksum it is computing finishes on its own (bounded by the
        payload size), queued ones are dropped."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def spare_cores() -> bool:
    """Whether this process may run on 4 or more CPUs (then a checksum thread pays off);
    ``TIERKV_CHECKSUM_THREAD=1`` / ``0`` overrides."""
    forced = os.environ.get("TIERKV_CHECKSUM_THREAD")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return len(os.sched_getaffinity(0)) >= 4
    except AttributeError:  # not on Linux
        return (os.cpu_count() or 1) >= 4


def _settle(done: Future[int], out: asyncio.Future[int]) -> None:
    if out.done() or done.cancelled():
        if not out.done():
            out.cancel()
        return
    exc = done.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(done.result())
