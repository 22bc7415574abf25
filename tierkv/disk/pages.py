"""`DiskPages`: pages on local disk that survive restarts and are verified on every read.

::

    disk = DiskPages.open("/nvme/kv", page_bytes=256 << 10, disk_bytes=64 << 30)
    status = await disk.write(keys, host_rows)     # StoreStatus per key
    hits = await disk.read(keys, host_rows)        # bit-exact, or a miss (never damaged bytes)
    disk.free(disk.victims(8))                     # the caller's policy evicts
    disk.close()

The medium only: a slot allocator, its index and the I/O. Which pages go to disk and which
leave is the caller's policy (`victims` offers LRU order as a default).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from tierkv.errors import InvalidInputError
from tierkv.transports.crc32c_native import native_crc32c, slot_kernels

from .args import check_buffers, check_keys
from .errors import DiskClosedError, DiskConfigError
from .index import Reserved, SlotIndex
from .io import CORRUPT, OK, ReadItem, SlotIO, WriteItem
from .layout import Geometry
from .open import Opened, open_files
from .ops import IoPool, Outcome, settle
from .recover import recover
from .stats import Counters, DiskStats
from .status import StoreStatus

log = logging.getLogger("tierkv.disk")

_PRIVATE_BIT = 0x80  # tierkv.keys: a key whose first byte has the top bit set is private
_LOGGED_CORRUPT = 10


MAX_IO_THREADS = 1024
"""The most I/O threads a disk opens (the queue depth: 8 reads at the device's rate)."""


class DiskPages:
    """Fixed-size pages in preallocated segment files under one directory.

    Thread-safe. Reads and writes run on `io_threads` I/O threads; ``submit_*`` return
    ``concurrent.futures.Future`` (for engine jobs and blocking callers), the ``async`` forms
    await them without polling and, when cancelled, return only once no thread touches the
    caller's buffers (the batch still completes: nothing is left half-committed).
    """

    def __init__(self, opened: Opened, geometry: Geometry, io_threads: int) -> None:
        """Use `DiskPages.open`."""
        self._opened = opened
        self.geometry = geometry
        self.path = opened.path
        crc = native_crc32c()
        if crc is None:
            raise DiskConfigError(
                "the disk medium needs CRC-32C: tierkv.transports._crc32c was not built and "
                "the crc32c package is not installed (or TIERKV_NATIVE_CHECKSUM=0)"
            )
        self._io = SlotIO(
            geometry.page_bytes, geometry.key_bytes, not opened.mode_reason, crc, slot_kernels()
        )
        self._pool = IoPool(io_threads, geometry.payload_bytes)
        self._index = SlotIndex(geometry.capacity)
        self._c = Counters()
        self._closed = False
        self.recovered = 0

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        page_bytes: int,
        disk_bytes: int,
        key_bytes: int = 16,
        segment_bytes: int = 1 << 30,
        io_threads: int = 4,
        direct: bool = True,
        overwrite: bool = False,
    ) -> DiskPages:
        """Open (creating when new) the pages under the existing directory `path`, recovering
        the index of the content pages a previous process left there.

        `disk_bytes` bounds the segment files (slots of a 4 KiB header plus the page padded to
        4 KiB); `direct=False` forces buffered I/O. A non-empty `path` that no disk tier made
        (no lock or layout file) is refused, DiskForeignDirError, unless `overwrite=True`
        (the disk tier's files are added beside the ones there, which are kept). Raises
        DiskConfigError (bad sizes, a missing or read-only directory), DiskLayoutError (PATH
        holds another page size), DiskInUseError (another process has PATH open),
        DiskSpaceError (the segments cannot be preallocated); nothing is left created then.
        """
        if (
            isinstance(io_threads, bool)
            or not isinstance(io_threads, int)
            or not 1 <= io_threads <= MAX_IO_THREADS
        ):  # (each thread maps its own buffers: 10^5 of them were an OSError ENOMEM)
            raise DiskConfigError(
                f"io_threads must be an int in [1, {MAX_IO_THREADS}], got {io_threads!r:.40}"
            )
        if not isinstance(overwrite, bool):
            raise DiskConfigError(f"overwrite must be a bool, got {type(overwrite).__name__}")
        geometry = Geometry.plan(page_bytes, key_bytes, disk_bytes, segment_bytes)
        opened = open_files(os.fspath(path), geometry, direct, overwrite)
        try:
            self = cls(opened, geometry, io_threads)
        except BaseException:
            opened.release(remove_created=True)
            raise
        try:
            self._recover()
        except BaseException:
            self._pool.shut()
            self._pool.close()
            opened.release(remove_created=True)
            raise
        if opened.mode_reason:
            log.warning("disk pages at %s use buffered I/O: %s", self.path, opened.mode_reason)
        return self

    def _recover(self) -> None:
        found, next_gen, damaged = recover(self._io, self._pool, self._opened.fds, self.geometry)
        self._index.load(found, next_gen)
        self.recovered = len(found)
        self._c.damaged_at_open = damaged
        if damaged:
            log.warning("disk pages at %s: %d damaged slot headers at open", self.path, damaged)

    # -- properties ----------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """The size of every page."""
        return self.geometry.page_bytes

    @property
    def io_mode(self) -> str:
        """``"direct"`` (O_DIRECT) or ``"buffered"`` (then `stats().io_mode_reason` says why)."""
        return "buffered" if self._opened.mode_reason else "direct"

    # -- index ---------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot holding each key, None where the disk has no committed page of it."""
        self._check_open()
        return self._index.lookup(check_keys(self.geometry.key_bytes, keys))

    def free(self, keys: Sequence[bytes]) -> int:
        """Drop keys from the disk (the caller's eviction); returns how many were held. The
        bytes stay until the slot is reused (a content page may come back after a restart,
        verified as ever)."""
        self._check_open()
        return self._index.free(check_keys(self.geometry.key_bytes, keys))

    def victims(self, n: int) -> list[bytes]:
        """Up to `n` stored keys, least recently read or written first, that no read holds."""
        self._check_open()
        return self._index.victims(n)

    def reserve(self, keys: Sequence[bytes]) -> list[Reserved]:
        """Reserve a slot per key for a write (two-phase: `submit_store`, then `commit` or
        `abort`). A key already stored, being written, or without a free slot gets slot -1
        and ``why`` set."""
        self._check_open()
        return self._index.reserve(check_keys(self.geometry.key_bytes, keys))

    def commit(self, reserved: Sequence[Reserved], ok: Sequence[bool]) -> None:
        """Make the reservations whose write succeeded (`ok`) findable; return the others'
        slots. Only commit what `submit_store` reported written."""
        self._index.finish(zip(reserved, ok, strict=True))

    def abort(self, reserved: Sequence[Reserved]) -> None:
        """Return the reservations' slots unused."""
        self._index.finish((r, False) for r in reserved)

    # -- I/O -----------------------------------------------------------------------------------

    def submit_store(
        self,
        reserved: Sequence[Reserved],
        buffers: Sequence[Any],
        persistent: Sequence[bool] | None = None,
    ) -> Future[list[bool]]:
        """Write each reservation's page from its buffer (page_bytes each; they must not change
        until the future resolves). The future gives, per reservation, whether its page is on
        disk; nothing is committed (see `commit`). Raises InvalidInputError for bad buffers,
        DiskClosedError; nothing was written then."""
        views = check_buffers(buffers, len(reserved), self.page_bytes, writable=False)
        return self._store(list(reserved), views, persistent, commit=False)

    def submit_write(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        persistent: Sequence[bool] | None = None,
    ) -> Future[list[StoreStatus]]:
        """Reserve, write and commit: a StoreStatus per key. `persistent[i]` says whether key i
        is found again after a restart (default: content keys, whose first byte's top bit is
        clear, persist; private keys do not). Raises like `submit_store`."""
        self._check_open()
        keys = check_keys(self.geometry.key_bytes, keys)
        views = check_buffers(buffers, len(keys), self.page_bytes, writable=False)
        return self._store(self._index.reserve(keys), views, persistent, commit=True)

    async def write(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        persistent: Sequence[bool] | None = None,
    ) -> list[StoreStatus]:
        """`submit_write`, awaited."""
        return await settle(self.submit_write(keys, buffers, persistent))

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> Future[list[bool]]:
        """Read each key's page into its buffer (writable, page_bytes each); the future gives
        per key whether it was a verified hit. A miss leaves the buffer unspecified (zeroed
        where a damaged page was read into it); a page that fails verification is counted in
        `corrupt_pages` and freed. Raises InvalidInputError for bad keys or buffers,
        DiskClosedError; nothing changed then."""
        self._check_open()
        keys = check_keys(self.geometry.key_bytes, keys)
        views = check_buffers(buffers, len(keys), self.page_bytes, writable=True)
        entries = self._index.pin(keys)
        g, fds = self.geometry, self._opened.fds
        items, where = [], []
        for i, (k, e) in enumerate(zip(keys, entries, strict=True)):
            if e is not None:
                seg, off = g.place(e.slot)
                items.append(ReadItem(fds[seg], off, e.slot, k, e.generation, views[i]))
                where.append(i)
        t0 = time.perf_counter()

        def finish(outcomes: list[Outcome]) -> list[bool]:
            hits = [False] * len(keys)
            for i, (code, _) in zip(where, outcomes, strict=True):
                hits[i] = code == OK
            first = self._index.unpin((keys[i], entries[i], hits[i]) for i in where)  # type: ignore[misc]
            for (code, detail), new in zip(outcomes, first, strict=True):
                if new:
                    self._note_bad_read(code, detail)
            n_hits = sum(hits)
            with self._c.lock:
                self._c.hits += n_hits
                self._c.misses += len(keys) - n_hits
                self._c.bytes_read += n_hits * g.page_bytes
                if items:
                    self._c.observe(False, time.perf_counter() - t0)
            return hits

        try:
            return self._pool.run(items, self._io.read_batch, finish)
        except DiskClosedError as exc:  # closed in between
            self._index.unpin((keys[i], entries[i], True) for i in where)  # type: ignore[misc]
            raise DiskClosedError(f"disk pages at {self.path} are closed") from exc

    async def read(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """`submit_read`, awaited."""
        return await settle(self.submit_read(keys, buffers))

    def _store(
        self,
        reserved: list[Reserved],
        views: list[memoryview],
        persistent: Sequence[bool] | None,
        *,
        commit: bool,
    ) -> Future[Any]:
        self._check_open()
        if persistent is None:
            persist = [not (r.key and r.key[0] & _PRIVATE_BIT) for r in reserved]
        else:
            persist = [bool(p) for p in persistent]
            if len(persist) != len(reserved):
                if commit:
                    self.abort(reserved)
                raise InvalidInputError(f"{len(persist)} persistent flags for {len(reserved)} keys")
        g, fds = self.geometry, self._opened.fds
        items, where = [], []
        for i, r in enumerate(reserved):
            if r.slot >= 0:
                seg, off = g.place(r.slot)
                items.append(
                    WriteItem(fds[seg], off, r.slot, r.key, r.generation, persist[i], views[i])
                )
                where.append(i)
        t0 = time.perf_counter()

        def finish(outcomes: list[Outcome]) -> list[Any]:
            ok = [False] * len(reserved)
            for i, (code, detail) in zip(where, outcomes, strict=True):
                ok[i] = code == OK
                if code != OK:
                    with self._c.lock:
                        self._c.write_failures += 1
                        self._c.last_error = detail
            if commit:
                self.commit(reserved, ok)
            written = sum(ok)
            with self._c.lock:
                self._c.pages_written += written
                self._c.bytes_written += written * g.page_bytes
                self._c.no_room += sum(r.why == "no_room" for r in reserved)
                if items:
                    self._c.observe(True, time.perf_counter() - t0)
            if not commit:
                return ok
            return [
                StoreStatus.STORED
                if ok[i]
                else StoreStatus(r.why)
                if r.slot < 0
                else StoreStatus.FAILED
                for i, r in enumerate(reserved)
            ]

        try:
            return self._pool.run(items, self._io.write_batch, finish)
        except DiskClosedError as exc:
            if commit:
                self.abort(reserved)
            raise DiskClosedError(f"disk pages at {self.path} are closed") from exc

    def _note_bad_read(self, code: int, detail: str) -> None:
        with self._c.lock:
            if code == CORRUPT:
                self._c.corrupt_pages += 1
                n = self._c.corrupt_pages
            else:
                self._c.read_errors += 1
                n = self._c.read_errors
            self._c.last_error = detail
        if n <= _LOGGED_CORRUPT:
            what = "damaged page" if code == CORRUPT else "read error"
            log.warning("disk pages at %s: %s, counted as a miss: %s", self.path, what, detail)

    def _check_open(self) -> None:
        if self._closed:
            raise DiskClosedError(f"disk pages at {self.path} are closed")

    # -- stats and lifetime --------------------------------------------------------------------

    def stats(self) -> DiskStats:
        """A snapshot of the counters, the I/O mode and the slot accounting."""
        used, reserved, free = self._index.counts()
        return self._c.snapshot(
            io_mode=self.io_mode,
            io_mode_reason=self._opened.mode_reason,
            capacity=self.geometry.capacity,
            used=used,
            reserved=reserved,
            free=free,
            recovered=self.recovered,
        )

    def check(self) -> None:
        """Assert the index's invariants (tests)."""
        self._index.check()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the batches in flight (at most `timeout` s; None: no bound), then release
        the threads, buffers, files and lock (idempotent); those of batches still running (a
        hung disk) when the last ends, never under it (`IoPool.close_within`)."""
        if self._closed:
            return
        self._closed = True
        self._pool.close_within(timeout, partial(self._opened.release, remove_created=False))

    async def aclose(self, timeout: float | None = None) -> None:
        """`close` after awaiting the batches in flight on the loop (at most `timeout` s)."""
        if not self._closed:
            pending = [asyncio.wrap_future(f) for f in self._pool.shut()]
            if pending:
                await asyncio.wait(pending, timeout=timeout)
        self.close(0)

    def __enter__(self) -> DiskPages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> DiskPages:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        used, _, _ = self._index.counts()
        return f"<DiskPages {self.path!r} {used}/{self.geometry.capacity} pages, {self.io_mode}>"
