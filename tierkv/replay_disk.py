"""Trace replay with a disk tier below the RAM tier (``tierkv replay --disk PATH``).

The RAM tier is the real :class:`~tierkv.page_table.PageTable` of :func:`tierkv.replay.replay`
(same semantics); below it a real disk medium (:class:`~tierkv.disk.DiskPages` in PATH, one
``page_bytes`` page per trace block, its content a function of the block id). A request's hits
are the leading run of its blocks that RAM or the disk holds; the disk's are read back
(verified: key, generation, CRC-32C; and compared with the block's content here: a wrong page
would raise) and inserted into RAM with the request's missing blocks (a page that fails
verification is a counted miss and ends the run). Blocks RAM evicts, declines to admit, or
cannot hold (a request longer than RAM) are written to the disk, which evicts its least
recently used pages for room.

The figures are the hit rate with the disk against RAM alone, the disk's hits, bytes read and
written, corrupt pages and its I/O mode: what a disk of that many blocks adds on the trace,
measured through the medium a store would use. A PATH used before holds the blocks of the
earlier replay (found at open: a restart), so a replay meant to start cold uses a fresh one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.disk import DiskPages, DiskStats
from tierkv.disk.layout import ALIGN
from tierkv.errors import PageTableError, TierKVError
from tierkv.page_table import PageTable
from tierkv.policies import DEFAULT_POLICY, PageHint
from tierkv.progress import Progress
from tierkv.replay import Trace
from tierkv.runtime.arena import allocate_host_buffer

__all__ = ["DiskReplayResult", "WrongPageError", "replay_with_disk"]

_TIER = "cache"


class WrongPageError(TierKVError):
    """The disk served a page whose bytes are not the block's: never expected (a read is
    verified); raised so that a replay can never report such a hit."""


@dataclass(frozen=True, slots=True)
class DiskReplayResult:
    """Outcome of a replay with a disk tier."""

    policy: str
    capacity_blocks: int
    disk_blocks: int
    ram_hits: int
    disk_hits: int
    blocks: int
    requests: int
    disk: DiskStats

    @property
    def hit_rate(self) -> float:
        """Block hits (RAM and disk) / all blocks."""
        return (self.ram_hits + self.disk_hits) / self.blocks if self.blocks else 0.0

    @property
    def ram_hit_rate(self) -> float:
        """RAM hits / all blocks (the hit rate a replay without the disk has)."""
        return self.ram_hits / self.blocks if self.blocks else 0.0


def _key(block: int) -> bytes:
    """The disk key of a trace block id (a content key: top bit of the first byte clear)."""
    return (block & ((1 << 127) - 1)).to_bytes(16, "big", signed=False)


class _Rows:
    """Page-aligned host rows for one request's reads or writes (grown on demand)."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self._buf = allocate_host_buffer(page_bytes)
        self._n = 1

    def take(self, n: int) -> list[np.ndarray]:
        if n > self._n:
            self._n = max(n, 2 * self._n)
            self._buf = allocate_host_buffer(self._n * self.page_bytes)
        pb = self.page_bytes
        return [self._buf[i * pb : (i + 1) * pb] for i in range(n)]


def _content(block: int, page_bytes: int) -> np.ndarray:
    """The page of a block: its id repeated (cheap to make and to check)."""
    word = np.array([block & ((1 << 63) - 1)], dtype=np.int64).view(np.uint8)
    return np.resize(word, page_bytes)


def replay_with_disk(
    trace: Trace,
    capacity_blocks: int,
    path: str | os.PathLike[str],
    disk_blocks: int,
    *,
    policy: str = DEFAULT_POLICY,
    page_bytes: int = 4096,
    progress: bool = False,
) -> DiskReplayResult:
    """Replay ``trace`` through a RAM tier of ``capacity_blocks`` and a disk tier of
    ``disk_blocks`` pages of ``page_bytes`` in ``path`` (an existing directory).

    Raises tierkv.disk's DiskError subclasses for an unusable path (nothing created),
    InvalidInputError for bad sizes, WrongPageError if the disk ever served wrong bytes.
    """
    slot = ALIGN + -(-page_bytes // ALIGN) * ALIGN
    disk = DiskPages.open(path, page_bytes=page_bytes, disk_bytes=disk_blocks * slot)
    try:
        ram, hits_disk = _replay(trace, capacity_blocks, policy, disk, progress)
        stats = disk.stats()
    finally:
        disk.close()
    blocks = sum(len(ids) for ids in trace)
    return DiskReplayResult(
        policy, capacity_blocks, disk_blocks, ram, hits_disk, blocks, len(trace), stats
    )


def _replay(
    trace: Trace, capacity: int, policy: str, disk: DiskPages, progress: bool
) -> tuple[int, int]:
    table = PageTable({_TIER: capacity}, policy, record_events=False)
    rows = _Rows(disk.page_bytes)
    ram_hits = disk_hits = 0
    with Progress(len(trace), f"replay {policy} + disk", enabled=progress) as bar:
        for ids in trace:
            bar.update()
            n = len(ids)
            if not n:
                continue
            in_ram, d = _hit_run(table, disk, ids, rows)
            ram_hits += len(in_ram)
            disk_hits += d
            h = len(in_ram) + d  # the request's reused prefix
            if in_ram:  # read: pin, then unpin and record the use
                table.prepare_load(in_ram, _TIER)
                table.complete_load(in_ram, _TIER)
            cut = ids[capacity:]  # a request larger than RAM keeps its head there
            if cut:
                ids, n = ids[:capacity], capacity
            others = table.present([b for b in ids if b not in set(in_ram)], _TIER)
            if others:
                table.touch(others, _TIER)
            hints = [PageHint(j, j == n - 1, h, ids[j - 1] if j else None, n) for j in range(n)]
            alloc = table.prepare_store(ids, _TIER, hints)
            if alloc is None:  # cannot happen in a one-tier replay: nothing stays pinned
                raise PageTableError("page table refused a store with nothing pinned")
            table.complete_store(alloc.keys, _TIER)
            _write(disk, [*alloc.evicted, *alloc.rejected, *cut], rows)
    return ram_hits, disk_hits


def _hit_run(
    table: PageTable, disk: DiskPages, ids: Sequence[int], rows: _Rows
) -> tuple[list[int], int]:
    """The request's leading run of blocks that RAM or the disk holds: the RAM ones, and how
    many came back from the disk (read and verified; a failed read ends the run there)."""
    ram = set(table.present(ids, _TIER))
    rest = [b for b in ids if b not in ram]
    on_disk = {b for b, s in zip(rest, disk.lookup([_key(b) for b in rest]), strict=True) if s}
    run = 0
    while run < len(ids) and (ids[run] in ram or ids[run] in on_disk):
        run += 1
    want = [b for b in ids[:run] if b not in ram]
    got = _read(disk, want, rows)
    if got < len(want):  # the run ends at the first block the disk did not deliver
        run = ids.index(want[got])
    return [b for b in ids[:run] if b in ram], min(got, len(want))


def _read(disk: DiskPages, blocks: Sequence[int], rows: _Rows) -> int:
    """Read ``blocks`` from the disk; how many of the first ones came back whole."""
    if not blocks:
        return 0
    out = rows.take(len(blocks))
    got = disk.submit_read([_key(b) for b in blocks], out).result()
    n = 0
    for b, ok, row in zip(blocks, got, out, strict=True):
        if not ok:
            break
        if not np.array_equal(row, _content(b, disk.page_bytes)):
            raise WrongPageError(f"the disk served wrong bytes for block {b}")
        n += 1
    return n


def _write(disk: DiskPages, blocks: Sequence[Any], rows: _Rows) -> None:
    """Write the blocks leaving RAM that the disk lacks (LRU pages freed for room)."""
    want = list(dict.fromkeys(blocks))
    new = [b for b, s in zip(want, disk.lookup([_key(b) for b in want]), strict=True) if s is None]
    new = new[: disk.stats().capacity]
    if not new:
        return
    short = len(new) - disk.stats().free
    if short > 0:
        disk.free(disk.victims(short))
    src = rows.take(len(new))
    for row, b in zip(src, new, strict=True):
        row[:] = _content(b, disk.page_bytes)
    disk.submit_write([_key(b) for b in new], src).result()
