"""The native slot-header kernels of the disk medium (`check_slots` / `pack_slots` in
transports/_crc32c.c) against the Python header code they replace on the I/O threads: the same
bytes written, the same verdict on every header read back (hostile ones included), and the
Python path still whole where the kernels are not in use."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tierkv.disk.pages as dpages
from tierkv.disk import StoreStatus
from tierkv.disk.io import ReadItem, SlotIO
from tierkv.disk.layout import ALIGN, FLAG_PERSISTENT, HEADER_BYTES, Header, pack_header
from tierkv.transports.crc32c_native import crc32c, slot_kernels

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import PAGE, assert_exact, flip_bits, key, open_disk, slot_offset, write_sync

K = slot_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the native CRC-32C is not in use here")


def _pages(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def _python_io(page_bytes: int, key_bytes: int) -> SlotIO:
    return SlotIO(page_bytes, key_bytes, True, crc32c, None)


def _columns(expected: list[tuple[bytes, int, int]]) -> tuple[list[Any], ...]:
    """Keys, generations and slots as the kernels take them."""
    return tuple(list(c) for c in zip(*expected, strict=True))


def _verdicts(
    block: Any, payloads: list[np.ndarray], expected: list[tuple[bytes, int, int]], page_bytes: int
) -> tuple[bytes, list[str]]:
    """(native verdict per page, Python `_check` reason per page) of headers in `block`."""
    native = K.check_slots(block, ALIGN, payloads, *_columns(expected), page_bytes)
    io = _python_io(page_bytes, len(expected[0][0]))
    view = memoryview(block)
    why = [
        io._check(
            ReadItem(0, 0, s, k, g, memoryview(p)),
            view[j * ALIGN : (j + 1) * ALIGN],
            memoryview(p),
            io.slot_bytes,
        )
        for j, ((k, g, s), p) in enumerate(zip(expected, payloads, strict=True))
    ]
    return native, why


@needs_kernels
@pytest.mark.parametrize("key_bytes", [16, 32])
@pytest.mark.parametrize("page_bytes", [PAGE, 5000])
def test_pack_slots_writes_the_python_header_bytes(key_bytes: int, page_bytes: int) -> None:
    rng = random.Random(key_bytes * page_bytes)
    n = 9
    payloads = _pages(n, page_bytes, 3)
    keys = [rng.randbytes(key_bytes) for _ in range(n)]
    gens = [rng.randrange(1 << 62) for _ in range(n)]
    slots = [rng.randrange(1 << 40) for _ in range(n)]
    flags = [rng.choice([0, FLAG_PERSISTENT]) for _ in range(n)]
    block = bytearray(b"\xaa" * (ALIGN * n))  # garbage past each header is zeroed
    K.pack_slots(block, ALIGN, payloads, keys, gens, slots, flags, page_bytes)
    for j in range(n):
        want = bytearray(ALIGN)
        h = Header(flags[j], keys[j], gens[j], page_bytes, crc32c(payloads[j]), slots[j])
        pack_header(memoryview(want), h, crc32c)
        assert block[j * ALIGN : (j + 1) * ALIGN] == want, j


@needs_kernels
def test_check_slots_agrees_with_the_python_check_on_every_field() -> None:
    n = 4
    payloads = _pages(n, PAGE, 5)
    expected = [(key(i), 100 + i, 7 + i) for i in range(n)]
    block = bytearray(ALIGN * n)
    K.pack_slots(block, ALIGN, payloads, *_columns(expected), [FLAG_PERSISTENT] * n, PAGE)
    native, why = _verdicts(block, payloads, expected, PAGE)
    assert native == bytes(n) and why == [""] * n
    # what the index expects differs from what the header says: one verdict per field
    k0, g0, s0 = expected[0]
    for other, code in (
        ((key(99), g0, s0), 2),
        ((k0, g0 + 1, s0), 3),
        ((k0, g0, s0 + 1), 4),
    ):
        native, why = _verdicts(block, payloads, [other, *expected[1:]], PAGE)
        assert native[0] == code and why[0] and native[1:] == bytes(n - 1), (other, why)
    native, why = _verdicts(block, payloads, expected, PAGE - 1000)  # another page size
    assert all(c == 4 for c in native) and all(why)
    # every bit of the header's fields, and payload bits
    for byte in range(HEADER_BYTES):
        for bit in (0, 5):
            damaged = bytearray(block)
            damaged[byte] ^= 1 << bit
            native, why = _verdicts(damaged, payloads, expected, PAGE)
            assert (native[0] != 0) == bool(why[0]) and native[0] != 0, (byte, bit)
            assert native[1:] == bytes(n - 1)
    flipped = [p.copy() for p in payloads]
    flipped[2][PAGE - 1] ^= 0x10
    native, why = _verdicts(block, flipped, expected, PAGE)
    assert list(native) == [0, 0, 5, 0] and why[2] == "payload CRC mismatch"


@needs_kernels
@given(
    edits=st.lists(
        st.tuples(st.integers(0, HEADER_BYTES - 1), st.integers(0, 255)), min_size=1, max_size=6
    ),
    seal=st.booleans(),
    key_bytes=st.sampled_from([16, 32]),
)
def test_check_slots_agrees_with_python_on_hostile_headers(
    edits: list[tuple[int, int]], seal: bool, key_bytes: int
) -> None:
    payload = _pages(1, PAGE, 1)
    k = key(0) + (key(1) if key_bytes == 32 else b"")
    block = bytearray(ALIGN)
    pack_header(memoryview(block), Header(1, k, 5, PAGE, crc32c(payload[0]), 0), crc32c)
    for at, value in edits:
        block[at] = value
    if seal:  # a valid header CRC over the edited fields: the field checks must decide
        block[72:76] = crc32c(bytes(block[:72])).to_bytes(4, "little")
    native, why = _verdicts(block, payload, [(k, 5, 0)], PAGE)
    assert (native[0] == 0) == (why[0] == ""), (native, why)


@needs_kernels
def test_kernels_refuse_bad_arguments_before_touching_anything() -> None:
    p = _pages(2, PAGE, 2)
    ks, gens, slots = [key(0), key(1)], [1, 2], [0, 1]
    block = bytearray(ALIGN * 2)
    bad: list[tuple[Any, ...]] = [
        (block, ALIGN, p, ks[:1], gens, slots, PAGE),  # lengths differ
        (block, ALIGN, p, [b"short", ks[1]], gens, slots, PAGE),  # key size
        (block, ALIGN, [p[0], p[1][:100]], ks, gens, slots, PAGE),  # a short payload
        (block[: ALIGN + 10], ALIGN, p, ks, gens, slots, PAGE),  # the headers do not fit
        (block, 10, p, ks, gens, slots, PAGE),  # a stride shorter than a header
        (block, ALIGN, p, ks, [-1, 2], slots, PAGE),  # a negative generation
    ]
    for args in bad:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            K.check_slots(*args)
        with pytest.raises((ValueError, TypeError, OverflowError)):
            K.pack_slots(*args[:6], [0, 0], args[6])
    assert block == bytearray(ALIGN * 2)
    with pytest.raises(BufferError):
        K.pack_slots(b"\0" * ALIGN * 2, ALIGN, p, ks, gens, slots, [0, 0], PAGE)  # read-only
    with pytest.raises(ValueError):
        K.pack_slots(block, ALIGN, p, ks, gens, slots, [0, 1 << 16], PAGE)  # flags over u16
    assert K.check_slots(block, ALIGN, [], [], [], [], PAGE) == b""


@needs_kernels
def test_the_disk_medium_uses_the_kernels(tmp_path: Path) -> None:
    with open_disk(tmp_path) as disk:
        assert disk._io.kernels is K


def test_the_python_path_reads_writes_and_catches_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernels are not in use (the crc32c package's CRC), headers are packed and
    checked in Python: pages round-trip bit-exact, damage is a counted miss."""
    monkeypatch.setattr(dpages, "slot_kernels", lambda: None)
    keys = [key(i) for i in range(8)]
    with open_disk(tmp_path) as disk:
        assert disk._io.kernels is None
        assert write_sync(disk, keys) == [StoreStatus.STORED] * 8
        assert assert_exact(disk, keys) == [True] * 8
    f, base = slot_offset(tmp_path, 3, 4, ALIGN + PAGE)
    flip_bits(f, [(base + ALIGN + 100, 2)])
    with open_disk(tmp_path) as disk:
        assert assert_exact(disk, keys) == [i != 3 for i in range(8)]
        assert disk.stats().corrupt_pages == 1
