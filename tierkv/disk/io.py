"""Positional vectored I/O of slots, run on the I/O threads (``os.preadv``/``os.pwritev`` release
the GIL): O_DIRECT from page-aligned buffers where the filesystem takes it, buffered otherwise.

Nothing here touches the index: a batch function gets a plan (which slot, which key and
generation, which caller buffer) and returns one outcome per page.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    """"" when O_DIRECT works for `probe_file` (an existing segment), else why not."""
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


class Scratch:
    """One I/O thread's aligned buffers: a slot header and a bounce payload for callers'
    buffers that O_DIRECT cannot use as they are (unaligned, or a page not a multiple of ALIGN)."""

    def __init__(self, payload_bytes: int) -> None:
        self._buf = AlignedBuffer(ALIGN + payload_bytes)
        self.header = self._buf.view[:ALIGN]
        self.payload = self._buf.view[ALIGN:]

    def close(self) -> None:
        """Release the buffers."""
        self.header.release()
        self.payload.release()
        self._buf.close()


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use `view` as it is (address and length multiples of ALIGN)."""
    if len(view) % ALIGN:
        return False
    return int(np.frombuffer(view, np.uint8).ctypes.data) % ALIGN == 0


@dataclass(frozen=True, slots=True)
class ReadItem:
    """One page to read: where, what the index expects there, and the caller's buffer."""

    fd: int
    offset: int
    slot: int
    key: bytes
    generation: int
    dst: memoryview


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One page to write: where, its header's fields, and the caller's bytes."""

    fd: int
    offset: int
    slot: int
    key: bytes
    generation: int
    persistent: bool
    src: memoryview


class SlotIO:
    """The blocking batch functions the I/O threads run for one open PATH."""

    def __init__(self, page_bytes: int, key_bytes: int, direct: bool, crc: Crc) -> None:
        self.page_bytes = page_bytes
        self.key_bytes = key_bytes
        self.direct = direct
        self.crc = crc
        # O_DIRECT can move a caller's buffer only when the page is a whole number of blocks
        self._direct_page = page_bytes % ALIGN == 0

    def read_batch(self, items: Sequence[ReadItem], scratch: Scratch) -> list[tuple[int, str]]:
        """Read and verify each item into its buffer; (outcome, detail) per item. A page that
        fails verification has its buffer zeroed: damaged bytes never reach the caller."""
        return [self._read_one(it, scratch) for it in items]

    def _read_one(self, it: ReadItem, scratch: Scratch) -> tuple[int, str]:
        pb = self.page_bytes
        bounce = self.direct and not (self._direct_page and is_aligned(it.dst))
        payload = scratch.payload if bounce else it.dst
        want = ALIGN + len(payload)
        try:
            n = os.preadv(it.fd, [scratch.header, payload], it.offset)
        except OSError as exc:
            self._zero(it.dst, bounce)
            return OS_ERROR, f"read of slot {it.slot}: {exc}"
        why = ""
        if n != want:
            why = f"short read ({n} of {want} bytes)"
        else:
            h = unpack_header(scratch.header[:HEADER_BYTES], self.crc)
            if h is None:
                why = "no intact header"
            elif h.key != it.key:
                why = "another key in the header"
            elif h.generation != it.generation:
                why = f"generation {h.generation}, expected {it.generation}"
            elif h.slot != it.slot or h.length != pb:
                why = "header of another slot or page size"
            elif self.crc(payload[:pb], 0) != h.payload_crc:
                why = "payload CRC mismatch"
        if why:
            self._zero(it.dst, bounce)
            self._clear(it.fd, it.offset, it.slot, scratch)  # not recovered again at reopen
            return CORRUPT, f"slot {it.slot}: {why}"
        if bounce:
            it.dst[:] = payload[:pb]
        return OK, ""

    @staticmethod
    def _zero(dst: memoryview, bounce: bool) -> None:
        if not bounce:  # the read went into the caller's buffer: wipe what landed there
            np.frombuffer(dst, np.uint8)[:] = 0

    def write_batch(self, items: Sequence[WriteItem], scratch: Scratch) -> list[tuple[int, str]]:
        """Write each item (header and payload in one pwritev); (outcome, detail) per item. A
        failed or short write has its header cleared where the OS still allows it."""
        return [self._write_one(it, scratch) for it in items]

    def _write_one(self, it: WriteItem, scratch: Scratch) -> tuple[int, str]:
        pb = self.page_bytes
        src = it.src
        if self.direct and not (self._direct_page and is_aligned(src)):
            scratch.payload[:pb] = src
            src = scratch.payload
        flags = FLAG_PERSISTENT if it.persistent else 0
        crc = self.crc(it.src, 0)
        header = Header(flags, it.key, it.generation, pb, crc, it.slot)
        pack_header(scratch.header, header, self.crc)
        want = ALIGN + len(src)
        try:
            n = os.pwritev(it.fd, [scratch.header, src], it.offset)
        except OSError as exc:
            self._clear(it.fd, it.offset, it.slot, scratch)
            return OS_ERROR, f"write of slot {it.slot}: {exc}"
        if n != want:
            self._clear(it.fd, it.offset, it.slot, scratch)
            return OS_ERROR, f"write of slot {it.slot}: short write ({n} of {want} bytes)"
        return OK, ""

    @staticmethod
    def _clear(fd: int, offset: int, slot: int, scratch: Scratch) -> None:
        # Best effort: the slot goes back to the free list either way, and a header left behind
        # still fails verification (its payload no longer matches) if this fails too.
        np.frombuffer(scratch.header, np.uint8)[:HEADER_BYTES] = 0
        try:
            os.pwritev(fd, [scratch.header], offset)
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
                self._clear(fd, offset, slot, scratch)
        return found, damaged

    def _fits(self, h: Header, slot: int) -> bool:
        return (
            h.slot == slot
            and h.length == self.page_bytes
            and len(h.key) == self.key_bytes
            and h.generation < GENERATION_LIMIT
        )
