"""The disk as a tier of the store: `DiskTier` (the `tierkv.tier.Tier` interface over
`DiskPages`) and its host <-> disk moves, registered by (medium, medium)::

    moves = Moves()
    register_moves(moves)                                  # (host, disk) and (disk, host)
    tier = DiskTier.open(path, page_bytes=..., disk_bytes=...)
    batch = Batch(keys, host_arena, slots)
    handle = moves.get(HOST, DISK)(engine, tier, batch)    # a StoreStatus each
    handle = moves.get(DISK, HOST)(engine, tier, batch)    # a verified hit each

The store's page keys (`tierkv.keys`: 18 bytes) are written zero-padded to the medium's 32-byte
keys; content keys stay content keys (the private bit is in the first byte), so a restarted
process finds the pages of the one before under the same keys. The tier holds content pages
only (`Holds.CONTENT`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tierkv.errors import InvalidInputError
from tierkv.runtime import TransferEngine, TransferHandle
from tierkv.tier import Batch, Holds, Moves
from tierkv.tier_names import DISK, HOST

from . import jobs
from .admission import SeenTwice
from .index import Reserved
from .pages import DiskPages

__all__ = ["DiskTier", "register_moves"]

_KEY_BYTES = 32


def _pad(keys: Sequence[bytes]) -> list[bytes]:
    out = []
    for k in keys:
        if not isinstance(k, bytes) or not 0 < len(k) < _KEY_BYTES:
            raise InvalidInputError(f"a page key must be 1..{_KEY_BYTES - 1} bytes, got {k!r:.60}")
        out.append(k + b"\x00" * (_KEY_BYTES - len(k)))
    return out


class DiskTier:
    """The disk tier: content pages in `DiskPages` under one directory (see docs/disk.md)."""

    medium = DISK
    holds = Holds.CONTENT

    close_timeout: float | None = None
    """The longest `close` waits for batches in flight (`DiskPages.close`; None: no bound)."""

    def __init__(self, pages: DiskPages, admission: SeenTwice | None = None) -> None:
        """Use `DiskTier.open` (or wrap pages opened with ``key_bytes=32``). `admission`:
        the filter of evicted pages (`admit`); None writes every one."""
        if pages.geometry.key_bytes != _KEY_BYTES:
            raise InvalidInputError(f"a disk tier needs {_KEY_BYTES}-byte disk keys")
        self.pages = pages
        self.admission = admission

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        page_bytes: int,
        disk_bytes: int,
        seen_twice: bool = False,
        close_timeout: float | None = None,
        **kw: Any,
    ) -> DiskTier:
        """`DiskPages.open` with the tier's key size; raises what it raises (nothing created).
        `seen_twice`: write an evicted page only on its second offer (`SeenTwice`, remembering
        four times the disk's pages; off by default: docs/disk.md, "Admission");
        `close_timeout`: the attribute's (a store gives its timeout)."""
        pages = DiskPages.open(
            path, page_bytes=page_bytes, disk_bytes=disk_bytes, **kw, key_bytes=_KEY_BYTES
        )
        tier = cls(pages, SeenTwice(4 * pages.geometry.capacity) if seen_twice else None)
        tier.close_timeout = close_timeout
        return tier

    def accepts(self, key: bytes) -> bool:
        """Content pages only."""
        return self.holds.accepts(key)

    def disk_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The medium's keys of these page keys."""
        return _pad(keys)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a committed page of it is on disk (the index: no I/O)."""
        return [s is not None for s in self.pages.lookup(_pad(keys))]

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Per evicted page, whether to write it: the admission filter's verdict (each call
        counts as an offer of these keys), or True for all without a filter."""
        if self.admission is None:
            return [True] * len(keys)
        return self.admission.admit(list(keys))

    def reserve(self, keys: Sequence[bytes]) -> list[Reserved]:
        """`DiskPages.reserve` under the medium's keys."""
        return self.pages.reserve(_pad(keys))

    def commit(self, reserved: Sequence[Any], ok: Sequence[bool]) -> None:
        """`DiskPages.commit`."""
        self.pages.commit(reserved, ok)

    def abort(self, reserved: Sequence[Any]) -> None:
        """`DiskPages.abort`."""
        self.pages.abort(reserved)

    def free(self, keys: Sequence[bytes]) -> int:
        """`DiskPages.free` under the medium's keys."""
        return self.pages.free(_pad(keys))

    def make_room(self, n: int) -> int:
        """Free the least recently used pages until ``n`` slots are free (fewer when reads
        hold the rest); returns the pages freed."""
        short = n - self.pages.stats().free
        return self.pages.free(self.pages.victims(short)) if short > 0 else 0

    def stats(self) -> dict[str, Any]:
        """The medium's counters (`DiskStats`'s fields: the latency histograms as
        `Histogram`s) and its path."""
        s = self.pages.stats()
        out: dict[str, Any] = {name: getattr(s, name) for name in s.__slots__}
        out["path"] = self.pages.path
        if self.admission is not None:
            out["admission"] = self.admission.stats()
        out["read_latency"] = s.read_latency  # Histogram: cumulative counts per bound
        out["write_latency"] = s.write_latency
        return out

    def close(self) -> None:
        """Close the medium (its lock released), waiting at most `close_timeout` for the
        batches in flight (the rest is released when they end: `DiskPages.close`)."""
        self.pages.close(self.close_timeout)


def _save(engine: TransferEngine, tier: DiskTier, batch: Batch) -> TransferHandle:
    # (the medium keeps a CRC32C of its own per page: the batch's sums are not needed)
    keys = tier.disk_keys(batch.keys)
    return jobs.submit_save(engine, tier.pages, keys, batch.arena, batch.slots)


def _load(engine: TransferEngine, tier: DiskTier, batch: Batch) -> TransferHandle:
    keys = tier.disk_keys(batch.keys)
    return jobs.submit_load(engine, tier.pages, keys, batch.arena, batch.slots)


def register_moves(moves: Moves) -> None:
    """Register the host -> disk write and the disk -> host verified read."""
    moves.register(HOST, DISK, _save)
    moves.register(DISK, HOST, _load)
