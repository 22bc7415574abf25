"""Helpers of the disk medium's tests: deterministic pages, files to damage, a read-only dir."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np

from tierkv.disk import DiskPages
from tierkv.disk.layout import ALIGN, HEADER_BYTES, segment_name
from tierkv.runtime.arena import allocate_host_buffer

PAGE = 8192


def key(i: int, private: bool = False) -> bytes:
    """A 16-byte key numbered `i` (a private key has the top bit of its first byte set)."""
    k = bytearray(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())
    k[0] = (k[0] | 0x80) if private else (k[0] & 0x7F)
    return bytes(k)


def page(k: bytes, nbytes: int = PAGE) -> np.ndarray:
    """The page content of key `k`: pseudo-random, a function of the key only."""
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def open_disk(path: Path | str, slots: int = 16, page_bytes: int = PAGE, **kw: object) -> DiskPages:
    """DiskPages of `slots` slots of `page_bytes` pages, 4 slots per segment."""
    slot = ALIGN + -(-page_bytes // ALIGN) * ALIGN
    kw.setdefault("segment_bytes", 4 * slot)
    return DiskPages.open(path, page_bytes=page_bytes, disk_bytes=slots * slot, **kw)  # type: ignore[arg-type]


def rows(n: int, nbytes: int) -> list[np.ndarray]:
    """`n` page-aligned rows of a host arena (what O_DIRECT moves without a bounce)."""
    arena = allocate_host_buffer(max(1, n) * nbytes)
    return [arena[i * nbytes : (i + 1) * nbytes] for i in range(n)]


def write_sync(disk: DiskPages, keys: list[bytes], **kw: object) -> list[object]:
    """Write the pages of `keys` from arena rows (blocking)."""
    src = rows(len(keys), disk.page_bytes)
    for r, k in zip(src, keys, strict=True):
        r[:] = page(k, disk.page_bytes)
    return disk.submit_write(keys, src, **kw).result()  # type: ignore[arg-type]


def read_sync(disk: DiskPages, keys: list[bytes]) -> tuple[list[bool], list[np.ndarray]]:
    """Read `keys` into arena rows (blocking): hits and the rows."""
    out = rows(len(keys), disk.page_bytes)
    return disk.submit_read(keys, out).result(), out


def assert_exact(disk: DiskPages, keys: list[bytes]) -> list[bool]:
    """Read `keys`; every hit must equal its page bit for bit. Returns the hits."""
    hits, out = read_sync(disk, keys)
    for k, h, o in zip(keys, hits, out, strict=True):
        if h:
            assert np.array_equal(o, page(k, disk.page_bytes)), f"wrong bytes served for {k.hex()}"
    return hits


def slot_offset(
    disk_path: Path, slot: int, slots_per_segment: int, slot_bytes: int
) -> tuple[Path, int]:
    """The segment file and offset of `slot`'s header."""
    seg, i = divmod(slot, slots_per_segment)
    return disk_path / segment_name(seg), i * slot_bytes


def flip_bits(path: Path, offsets: list[tuple[int, int]]) -> None:
    """Flip bit `b` of byte `o` of file `path` for each (o, b)."""
    with open(path, "r+b") as f:
        for o, b in offsets:
            f.seek(o)
            byte = f.read(1)[0]
            f.seek(o)
            f.write(bytes([byte ^ (1 << b)]))


def random_flip_in_page(rng: random.Random, page_bytes: int) -> int:
    """An offset within a slot that belongs to its page: the header's fields or the payload."""
    if rng.random() < 0.3:
        return rng.randrange(HEADER_BYTES)
    return ALIGN + rng.randrange(page_bytes)


def read_only_dir(tmp: Path) -> Path:
    """A directory in which this process cannot create files (root ignores modes: use sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    d = tmp / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d
