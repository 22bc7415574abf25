"""Positional vectored I/O of slots, run on the I/O threads (``os.preadv``/``os.pwritev`` release
the GIL): O_DIRECT from page-aligned buffers where the filesystem takes it, buffered otherwise.

Nothing here touches the index: a batch function gets a plan (which slot, which key and
generation, which caller buffer) and returns one outcome per page.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .layout import ALIGN, FLAG_PERSISTENT, HEADER_BYTES, Header, pack_header, unpack_header

log = logging.getLogger("tierkv.disk")

Crc = Callable[[Any, int], int]

#: Filesystems whose pages live in memory: O_DIRECT has no device cache to bypass there.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})

#: Generations at or above this are refused at open (a hostile header could not overflow u64).
GENERATION_LIMIT = 1 << 62
_BLANK = bytes(HEADER_BYTES)  # a slot never written, or whose failed write was cleared

# Outcomes of one page's I/O.
OK = 0
CORRUPT = 1  # read back but failed verification (header, key, generation, length, CRC, short)
OS_ERROR = 2  # the OS failed the call (EIO, ENOSPC, EFBIG...)


def filesystem_of(path: str) -> str:
    """The filesystem type of the mount holding `path` (from /proc/self/mounts; "" if unknown)."""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, fstype = len(mnt), parts[2]
    except OSError:
        return ""
    return fstype


def choose_mode(path: str, probe_file: str, want_direct: bool) -> str:
    """ "" when O_DIRECT works for `probe_file` (an existing segment), else why not."""
    if not want_direct:
        return "O_DIRECT disabled by configuration (direct=False)"
    if not hasattr(os, "O_DIRECT"):
        return "O_DIRECT is not available on this platform"
    fstype = filesystem_of(path)
    if fstype in MEMORY_FILESYSTEMS:
        return f"{fstype} keeps its pages in memory: O_DIRECT would bypass nothing"
    try:
        fd = os.open(probe_file, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return f"the filesystem ({fstype or 'unknown'}) refused O_DIRECT at open: {exc.strerror}"
    buf = AlignedBuffer(ALIGN)
    try:
        os.preadv(fd, [buf.view], 0)
    except OSError as exc:
        return f"the filesystem ({fstype or 'unknown'}) refused an aligned O_DIRECT read: {exc}"
    finally:
        os.close(fd)
        buf.close()
    return ""


class AlignedBuffer:
    """Anonymous page-aligned memory (an mmap), released by close()."""

    def __init__(self, nbytes: int) -> None:
        self._mm = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        """Release the memory (no view of it may be in use)."""
        self.view.release()
        self._mm.close()


#: Most adjacent slots moved by one preadv / pwritev (a header and a payload iovec each).
MAX_RUN = 64


class Scratch:
    """One I/O thread's aligned buffers: MAX_RUN slot headers and a bounce payload for callers'
    buffers that O_DIRECT cannot use as they are (unaligned, or a page not a multiple of ALIGN)."""

    def __init__(self, payload_bytes: int) -> None:
        self._buf = AlignedBuffer(ALIGN * MAX_RUN + payload_bytes)
        #: the MAX_RUN headers as one buffer (the native kernels take a run of them at once)
        self.block = self._buf.view[: ALIGN * MAX_RUN]
        self.headers = [self._buf.view[i * ALIGN : (i + 1) * ALIGN] for i in range(MAX_RUN)]
        self.header = self.headers[0]
        self.payload = self._buf.view[ALIGN * MAX_RUN :]

    def close(self) -> None:
        """Release the buffers."""
        for h in self.headers:
            h.release()
        self.block.release()
        self.payload.release()
        self._buf.close()


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use `view` as it is (address and length multiples of ALIGN)."""
    if len(view) % ALIGN:
        return False
    if view.readonly:  # ctypes maps writable buffers only
        return int(np.frombuffer(view, np.uint8).ctypes.data) % ALIGN == 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


class ReadItem(NamedTuple):
    """One page to read: where, what the index expects there, and the caller's buffer (a
    tuple: the calling thread builds one per page, at half the cost of a frozen dataclass)."""

    fd: int
    offset: int
    slot: int
    key: bytes
    generation: int
    dst: memoryview


class WriteItem(NamedTuple):
    """One page to write: where, its header's fields, and the caller's bytes (a tuple)."""

    fd: int
    offset: int
    slot: int
    key: bytes
    generation: int
    persistent: bool
    src: memoryview


def _ids(run: Sequence[ReadItem] | Sequence[WriteItem]) -> tuple[list[bytes], list[int], list[int]]:
    """The keys, generations and slots of a run: the native kernels' per-page columns."""
    return [it.key for it in run], [it.generation for it in run], [it.slot for it in run]


class SlotIO:
    """The blocking batch functions the I/O threads run for one open PATH.

    A batch moves runs of adjacent slots with one call each (header and payload iovecs
    alternating, as they lie in the file), when the caller's buffers can go to the kernel as
    they are; any other page moves alone, through the bounce buffer under O_DIRECT.
    """

    def __init__(
        self, page_bytes: int, key_bytes: int, direct: bool, crc: Crc, kernels: Any = None
    ) -> None:
        self.page_bytes = page_bytes
        self.key_bytes = key_bytes
        self.direct = direct
        self.crc = crc
        #: the native batch kernels (`tierkv.transports.crc32c_native.slot_kernels`): a run's
        #: headers checked or packed, payload CRCs included, with the GIL released once; None:
        #: the same checks per page in Python (`_check`, `_pack`)
        self.kernels = kernels
        self.slot_bytes = ALIGN + -(-page_bytes // ALIGN) * ALIGN
        # pages that fill their payload area run together; O_DIRECT also needs aligned buffers
        self._whole = page_bytes % ALIGN == 0

    def _as_is(self, view: memoryview) -> bool:
        return self._whole and (not self.direct or is_aligned(view))

    def _runs(
        self, items: Sequence[ReadItem | WriteItem], views: list[memoryview]
    ) -> tuple[list[list[int]], list[bool]]:
        """Runs of adjacent slots (indices into `items`) and, per item, whether its buffer goes
        to the kernel as it is (a page that does not moves alone)."""
        runs: list[list[int]] = []
        as_is = [self._as_is(v) for v in views]
        prev: ReadItem | WriteItem | None = None
        for i, it in enumerate(items):
            if (
                as_is[i]
                and prev is not None
                and runs[-1][-1] == i - 1
                and len(runs[-1]) < MAX_RUN
                and it.fd == prev.fd
                and it.offset == prev.offset + self.slot_bytes
            ):
                runs[-1].append(i)
            else:
                runs.append([i])
            prev = it if as_is[i] else None
        return runs, as_is

    # -- reads ---------------------------------------------------------------------------------

    def read_batch(self, items: Sequence[ReadItem], scratch: Scratch) -> list[tuple[int, str]]:
        """Read and verify each item into its buffer; (outcome, detail) per item. A page that
        fails verification has its buffer zeroed (damaged bytes never reach the caller) and its
        header cleared (it is not found again after a restart)."""
        out: list[tuple[int, str]] = [(OK, "")] * len(items)
        runs, as_is = self._runs(items, [it.dst for it in items])
        for run in runs:
            if not as_is[run[0]]:
                out[run[0]] = self._read_bounced(items[run[0]], scratch)
                continue
            first = items[run[0]]
            iov: list[memoryview] = []
            for j, i in enumerate(run):
                iov += (scratch.headers[j], items[i].dst)
            try:
                n = os.preadv(first.fd, iov, first.offset)
            except OSError as exc:
                for i in run:
                    self._zero(items[i].dst)
                    out[i] = (OS_ERROR, f"read of slot {items[i].slot}: {exc}")
                continue
            codes = self._check_run([items[i] for i in run], n // self.slot_bytes, scratch)
            for j, i in enumerate(run):
                if j < len(codes) and not codes[j]:
                    continue  # verified by the native kernel
                got = min(max(0, n - j * self.slot_bytes), self.slot_bytes)
                it = items[i]
                why = self._check(it, scratch.headers[j], it.dst, got)
                if not why and j < len(codes):  # the two checks disagree: the stricter wins
                    why = f"failed the native check ({codes[j]})"
                if why:
                    self._zero(it.dst)
                    self._clear(it.fd, it.offset, it.slot, scratch.headers[j])
                    out[i] = (CORRUPT, f"slot {it.slot}: {why}")
        return out

    def _check_run(self, run: list[ReadItem], full: int, scratch: Scratch) -> bytes:
        """The native verdicts (0: verified) of the first `full` pages of a run read into
        `scratch`'s headers and the items' buffers; b"" without the kernels (every page is then
        checked by `_check`, as is any page whose verdict is not 0, for its message)."""
        if self.kernels is None or full <= 0:
            return b""
        run = run[:full]
        dst = [it.dst for it in run]
        return self.kernels.check_slots(scratch.block, ALIGN, dst, *_ids(run), self.page_bytes)

    def _read_bounced(self, it: ReadItem, scratch: Scratch) -> tuple[int, str]:
        payload = scratch.payload if self.direct else it.dst
        try:
            n = os.preadv(it.fd, [scratch.header, payload], it.offset)
        except OSError as exc:
            self._zero(it.dst)
            return OS_ERROR, f"read of slot {it.slot}: {exc}"
        got = n if n < ALIGN + len(payload) else self.slot_bytes
        why = self._check(it, scratch.header, payload, got)
        if why:
            self._zero(it.dst)
            self._clear(it.fd, it.offset, it.slot, scratch.header)
            return CORRUPT, f"slot {it.slot}: {why}"
        if payload is not it.dst:
            it.dst[:] = payload[: self.page_bytes]
        return OK, ""

    def _check(self, it: ReadItem, header: memoryview, payload: memoryview, got: int) -> str:
        """Why the slot read (`got` of its bytes) is not `it`'s page; "" when it is."""
        if got < self.slot_bytes:
            return f"short read ({got} of {self.slot_bytes} bytes)"
        h = unpack_header(header[:HEADER_BYTES], self.crc)
        if h is None:
            return "no intact header"
        if h.key != it.key:
            return "another key in the header"
        if h.generation != it.generation:
            return f"generation {h.generation}, expected {it.generation}"
        if h.slot != it.slot or h.length != self.page_bytes:
            return "header of another slot or page size"
        if self.crc(payload[: self.page_bytes], 0) != h.payload_crc:
            return "payload CRC mismatch"
        return ""

    @staticmethod
    def _zero(dst: memoryview) -> None:
        np.frombuffer(dst, np.uint8)[:] = 0

    # -- writes --------------------------------------------------------------------------------

    def write_batch(self, items: Sequence[WriteItem], scratch: Scratch) -> list[tuple[int, str]]:
        """Write each item (its header and payload); (outcome, detail) per item. A page not
        wholly written (an error, a short write) has its header cleared where the OS still
        allows it."""
        out: list[tuple[int, str]] = [(OK, "")] * len(items)
        runs, as_is = self._runs(items, [it.src for it in items])
        for run in runs:
            first = items[run[0]]
            iov: list[memoryview] = []
            self._pack_run([items[i] for i in run], scratch)
            for j, i in enumerate(run):
                it = items[i]
                src = it.src
                if not as_is[i]:  # alone, through the bounce buffer
                    scratch.payload[: self.page_bytes] = src
                    src = scratch.payload if self.direct else src
                iov += (scratch.headers[j], src)
            want = sum(len(v) for v in iov)
            try:
                n = os.pwritev(first.fd, iov, first.offset)
            except OSError as exc:
                n, why = 0, f"{exc}"
            else:
                why = f"short write ({n} of {want} bytes)"
            for j, i in enumerate(run):
                it = items[i]
                if n < want and n < (j + 1) * self.slot_bytes:
                    self._clear(it.fd, it.offset, it.slot, scratch.headers[j])
                    out[i] = (OS_ERROR, f"write of slot {it.slot}: {why}")
        return out

    def _pack_run(self, run: list[WriteItem], scratch: Scratch) -> None:
        """The headers of a run into `scratch`'s, payload CRCs included: one native call, or
        `_pack` per page without the kernels."""
        if self.kernels is None:
            for j, it in enumerate(run):
                self._pack(it, scratch.headers[j])
            return
        src = [it.src for it in run]
        flags = [FLAG_PERSISTENT if it.persistent else 0 for it in run]
        self.kernels.pack_slots(scratch.block, ALIGN, src, *_ids(run), flags, self.page_bytes)

    def _pack(self, it: WriteItem, header: memoryview) -> None:
        flags = FLAG_PERSISTENT if it.persistent else 0
        crc = self.crc(it.src, 0)
        pack_header(
            header, Header(flags, it.key, it.generation, self.page_bytes, crc, it.slot), self.crc
        )

    @staticmethod
    def _clear(fd: int, offset: int, slot: int, header: memoryview) -> None:
        # Best effort: the slot goes back to the free list either way, and a header left behind
        # still fails verification (its payload no longer matches) if this fails too.
        np.frombuffer(header, np.uint8)[:HEADER_BYTES] = 0
        try:
            os.pwritev(fd, [header], offset)
        except OSError as exc:
            log.debug("clearing the header of slot %d failed: %s", slot, exc)

    def scan(
        self, fd: int, first_slot: int, slots: int, slot_bytes: int, scratch: Scratch
    ) -> tuple[list[tuple[Header, int]], int]:
        """The intact headers of a segment's `slots` slots that this layout could hold,
        [(header, slot)], and how many were damaged (neither that nor blank; those are cleared,
        so that a damaged page is counted once). A header that cannot be read is a free slot."""
        found: list[tuple[Header, int]] = []
        damaged = 0
        for i in range(slots):
            slot, offset = first_slot + i, i * slot_bytes
            try:
                n = os.preadv(fd, [scratch.header], offset)
            except OSError as exc:
                log.warning("reading the header of slot %d failed: %s", slot, exc)
                continue
            if n != ALIGN or scratch.header[:HEADER_BYTES] == _BLANK:
                continue
            h = unpack_header(scratch.header[:HEADER_BYTES], self.crc)
            if h is not None and self._fits(h, slot):
                found.append((h, slot))
            else:
                damaged += 1
                self._clear(fd, offset, slot, scratch.header)
        return found, damaged

    def _fits(self, h: Header, slot: int) -> bool:
        return (
            h.slot == slot
            and h.length == self.page_bytes
            and len(h.key) == self.key_bytes
            and h.generation < GENERATION_LIMIT
        )
