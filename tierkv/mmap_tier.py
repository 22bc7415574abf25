"""A plug-in tier: content pages in a file-backed memory map, ``Mmap(path=, bytes=)``.

::

    import tierkv
    from tierkv.mmap_tier import Mmap            # registers the "mmap" kind
    KVStore(spec, tiers=[tierkv.Host(bytes=...), Mmap(path="/dev/shm/kv.map", bytes=32 << 30)])
    KVStore(spec, tiers=[{"tier": "host", ...}, {"tier": "mmap", "path": ..., "bytes": ...}])

What it is for: capacity below the pinned host budget with no I/O path of the store's own.
The file's pages are the OS page cache's: on tmpfs (``/dev/shm``) they are RAM that is neither
pinned nor counted in the host budget (the kernel may swap them), on a local filesystem the
kernel writes them back and reads them in on demand. It is scratch: the index is in memory, so
a new process never finds the pages of the one before (the disk tier is the one that survives
a restart); the file is created (its blocks allocated: a full filesystem is a typed error at
open, never a SIGBUS at a write), locked against a second store, and removed at close. Its first
4 KiB are a header naming it ours (`MAGIC`): an existing non-empty file without it (a mistyped
path, someone's data) is refused untouched, `MmapForeignFileError`, unless ``overwrite=True``.

Every page's CRC-32C is recorded when it is written and checked when it is read: a page whose
bytes changed (another writer of the file, a bad page of memory) is a counted miss, its slot
freed, and the bytes are never reported as a hit (the store rolls the host slot back).

It is a plug-in in the sense of issue 25: this module is all of it (so it stays whole, ~470
lines: a plug-in tier is one file). The entry registers itself
(`tierkv.chain_plugins.register_tier`), its moves host <-> mmap are handlers of the core's
`Moves` (one host-function job of the transfer engine each: the copy runs on the engine's
stream thread, the host slots the job's until it ends), and the core, the lower chain and the
store run it through the `Tier` interface alone. Content pages only; eviction by least recent
use.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from tierkv.chain_config import budget_bytes
from tierkv.chain_plugins import register_tier
from tierkv.errors import TierConfigError, TierSizeError, TierTypeError
from tierkv.jobs import when_done
from tierkv.page_sums import row_sums
from tierkv.runtime import Priority, TransferEngine, TransferHandle
from tierkv.spec import KVSpec
from tierkv.tier import Batch, Holds, Moves
from tierkv.tier_names import HOST
from tierkv.transports.crc32c_native import native_crc32c

__all__ = [
    "MAGIC",
    "MMAP",
    "Mmap",
    "MmapForeignFileError",
    "MmapInUseError",
    "MmapTier",
    "Written",
    "register_moves",
]

MMAP = "mmap"
MAGIC = b"TKVMMAP\x01"
"""The first bytes of a map's file: a file without them is not one of ours."""
HEADER_BYTES = mmap.ALLOCATIONGRANULARITY
"""The header's room at the file's start: the pages follow it (a mapping offset's unit)."""


class MmapInUseError(TierConfigError):
    """Another store (this process or another) holds the map's file."""


class MmapForeignFileError(TierConfigError):
    """The path holds a non-empty file that is not a map of ours (no `MAGIC`): left untouched
    (``overwrite=True`` takes it over)."""


@dataclass(frozen=True, slots=True)
class Written:
    """A page's status after a write into the map: ``held`` when it is there afterwards."""

    held: bool


def _checked_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a str; TierConfigError for a NUL in it (the OS could not open it)."""
    where = os.fspath(path)
    if "\0" in where:
        raise TierConfigError(f"mmap tier: the path {where!r} holds a NUL byte")
    return where


def _refuse_foreign(fd: int, where: Path) -> None:
    """MmapForeignFileError unless the file is empty or starts with `MAGIC` (read only)."""
    if os.fstat(fd).st_size == 0:
        return
    try:
        head = os.pread(fd, len(MAGIC), 0)
    except OSError as exc:
        raise TierConfigError(f"mmap tier: cannot read {where}: {exc.strerror}") from None
    if head != MAGIC:
        raise MmapForeignFileError(
            f"mmap tier: {where} is a file that is not an mmap tier's (no tierkv header): "
            "left untouched; give another path, or overwrite=True to truncate it (it is "
            "removed at close)"
        )


def _crcs(rows: npt.NDArray[np.uint8], slots: Sequence[int]) -> list[int]:
    if native_crc32c() is not None:
        return row_sums(rows, slots)
    return [zlib.crc32(rows[s]) for s in slots]  # (no CRC-32C here: zlib's CRC-32)


class MmapTier:
    """Pages of ``page_bytes`` in slots of a mapped file; the index in memory. Thread-safe:
    the moves' jobs read and write the rows on the engine's thread, the index is locked."""

    medium = MMAP
    holds = Holds.CONTENT

    def __init__(self, path: Path, fd: int, mapped: mmap.mmap, page_bytes: int) -> None:
        """Use `MmapTier.open`."""
        self.path = path
        self._fd = fd
        self._map: mmap.mmap | None = mapped
        n = (len(mapped) - HEADER_BYTES) // page_bytes
        rows = np.frombuffer(mapped, np.uint8, n * page_bytes, HEADER_BYTES)
        self.rows: npt.NDArray[np.uint8] = rows.reshape(n, page_bytes)
        self.page_bytes = page_bytes
        self.capacity = n
        self._lock = threading.Lock()
        self._slot: dict[bytes, int] = {}  # committed key -> slot
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # committed keys, oldest first
        self._sums = [0] * n  # the CRC of each committed slot's page
        self._free = list(range(n - 1, -1, -1))
        self._writing: set[bytes] = set()  # keys reserved, not committed yet
        self._reading: dict[int, int] = {}  # slot -> reads in flight
        self._doomed: set[int] = set()  # slots freed while read: free once the reads end
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "stored": 0, "evicted": 0}

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        page_bytes: int,
        nbytes: int,
        overwrite: bool = False,
    ) -> MmapTier:
        """Create the file at ``path`` (or take over an empty one, or one of ours a crashed
        process left), allocate ``nbytes`` of pages (whole pages, after a `HEADER_BYTES`
        header) and map it. Raises TierSizeError (not one page), TierConfigError (the
        directory is missing or not writable, no space; a path with a NUL, or one that is a
        symbolic link or not a regular file: refused before anything is written through it),
        MmapForeignFileError (a non-empty file without our header, unless ``overwrite``: it is
        truncated then, and removed at close), MmapInUseError (another store holds the file);
        nothing is left behind and an existing file is unchanged then."""
        if not isinstance(overwrite, bool):
            raise TierTypeError(f"mmap overwrite must be a bool, got {type(overwrite).__name__}")
        pages = int(nbytes) // page_bytes
        if pages < 1:
            raise TierSizeError(f"mmap budget holds no page: {nbytes} bytes, pages of {page_bytes}")
        where = Path(_checked_path(path))
        if not where.parent.is_dir():
            raise TierConfigError(f"mmap tier: {where.parent} is not a directory")
        created = not where.exists()
        try:  # never through a link: the file is truncated and, at close, removed
            fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            why = "a symbolic link" if where.is_symlink() else exc.strerror
            raise TierConfigError(f"mmap tier: cannot open {where}: {why}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TierConfigError(f"mmap tier: {where} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MmapInUseError(f"mmap tier: {where} is in use by another store") from None
            if not overwrite:
                _refuse_foreign(fd, where)
            size = HEADER_BYTES + pages * page_bytes
            try:
                os.ftruncate(fd, 0)  # (a previous process's pages mean nothing here)
                os.pwrite(fd, MAGIC, 0)  # ours from here on, even if this open dies
                os.posix_fallocate(fd, 0, size)  # no SIGBUS on a full tmpfs
                mapped = mmap.mmap(fd, size)
            except OSError as exc:
                raise TierConfigError(
                    f"mmap tier: cannot allocate {size} bytes in {where}: {exc.strerror}"
                ) from None
        except BaseException:
            os.close(fd)
            if created:
                where.unlink(missing_ok=True)
            raise
        return cls(where, fd, mapped, page_bytes)

    def accepts(self, key: bytes) -> bool:
        """Content pages only."""
        return self.holds.accepts(key)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a committed page of it is mapped (no I/O)."""
        with self._lock:
            return [k in self._slot for k in keys]

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Every page offered (no admission filter)."""
        return [True] * len(keys)

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """A free slot per key neither held nor being written, while slots are free; returns
        (key, slot) pairs (none for the others)."""
        out = []
        with self._lock:
            for k in dict.fromkeys(keys):
                if k in self._slot or k in self._writing or not self._free:
                    continue
                self._writing.add(k)
                out.append((k, self._free.pop()))
        return out

    def commit(
        self, reserved: Sequence[Any], ok: Sequence[bool], sums: Sequence[int] | None = None
    ) -> None:
        """Make the reservations whose write succeeded findable, with the CRC of each page
        (``sums``, one per reservation; computed from the rows when not given); return the
        others' slots."""
        good = [r for r, o in zip(reserved, ok, strict=True) if o]
        if sums is None:
            sums = _crcs(self.rows, [s for _, s in reserved])
        with self._lock:
            for (k, s), o, c in zip(reserved, ok, sums, strict=True):
                self._writing.discard(k)
                if o:
                    self._slot[k] = s
                    self._lru[k] = None
                    self._sums[s] = c
                else:
                    self._free.append(s)
            self.counters["stored"] += len(good)

    def abort(self, reserved: Sequence[Any]) -> None:
        """Return reserved slots unused."""
        self.commit(reserved, [False] * len(reserved), [0] * len(reserved))

    def _drop(self, key: bytes) -> None:
        s = self._slot.pop(key)
        self._lru.pop(key, None)
        if self._reading.get(s):
            self._doomed.add(s)
        else:
            self._free.append(s)

    def free(self, keys: Sequence[bytes]) -> int:
        """Drop keys; returns how many were held (a slot being read is reused after)."""
        with self._lock:
            held = [k for k in dict.fromkeys(keys) if k in self._slot]
            for k in held:
                self._drop(k)
        return len(held)

    def make_room(self, n: int) -> int:
        """Drop the least recently used pages until ``n`` slots are free; returns the pages
        dropped."""
        dropped = 0
        with self._lock:
            while len(self._free) < n and self._lru:
                self._drop(next(iter(self._lru)))
                dropped += 1
            self.counters["evicted"] += dropped
        return dropped

    def pin_reads(self, keys: Sequence[bytes]) -> list[int]:
        """The slot of each committed key (-1: not held), held for a read until
        `end_reads`; a hit is the most recent use."""
        out = []
        with self._lock:
            for k in keys:
                s = self._slot.get(k, -1)
                if s >= 0:
                    self._reading[s] = self._reading.get(s, 0) + 1
                    self._lru.move_to_end(k)
                out.append(s)
        return out

    def end_reads(
        self, keys: Sequence[bytes], slots: Sequence[int], hits: Sequence[bool] | None
    ) -> None:
        """Reads of `pin_reads` ended: count them; a read slot whose page failed its CRC is
        dropped (never found again). ``hits`` None: the read did not run (nothing counted)."""
        with self._lock:
            for i, (k, s) in enumerate(zip(keys, slots, strict=True)):
                if hits is None:
                    if s >= 0:
                        self._unpin(s)
                    continue
                h = hits[i]
                if s < 0:
                    self.counters["misses"] += 1
                    continue
                self._unpin(s)
                self.counters["hits" if h else "misses"] += 1
                if not h:
                    self.counters["corrupt"] += 1
                    if self._slot.get(k) == s:
                        self._drop(k)

    def _unpin(self, s: int) -> None:
        left = self._reading[s] - 1
        if left:
            self._reading[s] = left
        else:
            del self._reading[s]
            if s in self._doomed:
                self._doomed.discard(s)
                self._free.append(s)

    def sums_of(self, slots: Sequence[int]) -> list[int]:
        """The CRC recorded for each slot (read slots: pinned, so stable)."""
        with self._lock:
            return [self._sums[s] for s in slots]

    def stats(self) -> dict[str, Any]:
        """Pages used and free, the capacity, hits, misses, corrupt pages, the file."""
        with self._lock:
            used = len(self._slot)
            return {
                "used": used,
                "free": len(self._free),
                "capacity": self.capacity,
                **self.counters,
                "path": str(self.path),
            }

    def close(self) -> None:
        """Unmap, unlock and remove the file (idempotent)."""
        if self._map is None:
            return
        mapped, self._map = self._map, None
        self.rows = np.zeros((0, self.page_bytes), np.uint8)  # the map's last view goes
        mapped.close()
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def _save(engine: TransferEngine, tier: MmapTier, batch: Batch) -> TransferHandle:
    """host -> mmap: one host-function job copying the batch's host rows into reserved slots
    with their CRCs; committed when it ended, returned when it failed or was dropped. The
    result: a `Written` per key (held: there afterwards)."""
    keys, src, arena = list(batch.keys), list(batch.slots), batch.arena
    before = tier.lookup(keys)
    reserved = tier.reserve(keys)
    row_of = {k: i for i, k in enumerate(keys)}
    dst = [s for _, s in reserved]
    hs = [src[row_of[k]] for k, _ in reserved]
    written = {k for k, _ in reserved}
    sums: list[int] = []

    def work() -> list[Written]:
        if dst:
            tier.rows[dst] = arena.array[hs]
            sums.extend(_crcs(tier.rows, dst))
        return [Written(k in written or b) for k, b in zip(keys, before, strict=True)]

    try:
        handle = engine.submit_call(arena, src, arena, [], work, priority=Priority.WRITEBACK)
    except BaseException:
        tier.abort(reserved)
        raise

    def settle() -> None:
        if handle.state == "done" and handle.exception() is None and len(sums) == len(dst):
            tier.commit(reserved, [True] * len(reserved), sums)
        else:
            tier.abort(reserved)

    when_done(handle, settle)
    return handle


def _load(engine: TransferEngine, tier: MmapTier, batch: Batch) -> TransferHandle:
    """mmap -> host: one host-function job copying the held pages into the batch's host slots
    and checking each against its CRC. The result: True per verified hit."""
    keys, dst, arena = list(batch.keys), list(batch.slots), batch.arena
    slots = tier.pin_reads(keys)
    want = tier.sums_of([s for s in slots if s >= 0])
    hits: list[bool] = [False] * len(keys)

    def work() -> list[bool]:
        at = [i for i, s in enumerate(slots) if s >= 0]
        if at:
            arena.array[[dst[i] for i in at]] = tier.rows[[slots[i] for i in at]]
            got = _crcs(arena.array, [dst[i] for i in at])
            for i, w, g in zip(at, want, got, strict=True):
                hits[i] = w == g
        return list(hits)

    try:
        handle = engine.submit_call(arena, [], arena, dst, work, priority=Priority.PREFETCH)
    except BaseException:
        tier.end_reads(keys, slots, None)
        raise
    when_done(handle, lambda: tier.end_reads(keys, slots, _verdict(handle, hits)))
    return handle


def _verdict(handle: TransferHandle, hits: list[bool]) -> list[bool] | None:
    """The hits of a read that ended, None for one that did not run (or failed)."""
    return hits if handle.state == "done" and handle.exception() is None else None


def register_moves(moves: Moves) -> None:
    """Register the host -> mmap write and the mmap -> host verified read."""
    moves.register(HOST, MMAP, _save)
    moves.register(MMAP, HOST, _load)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mmap:
    """The chain entry of the mmap tier: ``path``, the file to map (created in an existing
    directory, removed at close); ``bytes``, its budget, at least one page; ``overwrite``:
    take over an existing file that is not one of ours (refused by default)."""

    kind: ClassVar[str] = MMAP
    path: str | os.PathLike[str]
    bytes: int
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise TierTypeError(f"mmap path must be a str or path, got {type(self.path).__name__}")
        _checked_path(self.path)
        budget_bytes(self.kind, self.bytes)  # the built-in entries' rule
        if not isinstance(self.overwrite, bool):
            raise TierTypeError(
                f"mmap overwrite must be a bool, got {type(self.overwrite).__name__}"
            )

    def check(self, spec: KVSpec) -> None:
        """The budget holds a page (TierSizeError)."""
        if int(self.bytes) < spec.page_bytes:
            raise TierSizeError(
                f"mmap budget holds no page: {self.bytes} bytes, pages are {spec.page_bytes}"
            )

    def open(self, spec: KVSpec) -> MmapTier:
        """Create and map the file (`MmapTier.open`)."""
        return MmapTier.open(
            self.path, page_bytes=spec.page_bytes, nbytes=self.bytes, overwrite=self.overwrite
        )

    def register_moves(self, moves: Moves) -> None:
        """The host <-> mmap moves."""
        register_moves(moves)


register_tier(Mmap)
