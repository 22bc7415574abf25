"""Fault tests of the disk medium: damaged, truncated, torn and hostile segment files, kill -9
during writes, OS write and read errors, EFBIG/ENOSPC, two processes on one path. Whatever
happens, a page served is bit-exact and every damaged page is counted."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv.disk.io as dio
from tierkv.disk import DiskInUseError, DiskPages, StoreStatus
from tierkv.disk.layout import ALIGN, HEADER_BYTES, Header, pack_header, unpack_header
from tierkv.transports.crc32c_native import crc32c

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import (
    PAGE,
    assert_exact,
    flip_bits,
    key,
    open_disk,
    page,
    random_flip_in_page,
    read_sync,
    slot_offset,
    write_sync,
)

CHILD = Path(__file__).with_name("disk_child.py")
ROOT = Path(__file__).resolve().parents[2]
SLOT = ALIGN + PAGE


def _child(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(CHILD), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _stored(tmp_path: Path, n: int, slots: int = 16) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with open_disk(tmp_path, slots=slots) as disk:
        assert write_sync(disk, keys) == [StoreStatus.STORED] * n
        assert disk.lookup(keys) == list(range(n))
    return keys


def test_flipped_bits_are_counted_never_served(tmp_path: Path) -> None:
    keys = _stored(tmp_path, 16)
    rng = random.Random(7)
    damaged: set[int] = set()
    for _ in range(40):
        slot = rng.randrange(16)
        f, base = slot_offset(tmp_path, slot, 4, SLOT)
        flip_bits(f, [(base + random_flip_in_page(rng, PAGE), rng.randrange(8))])
        damaged.add(slot)
    with open_disk(tmp_path) as disk:
        hits = assert_exact(disk, keys)
        st = disk.stats()
        assert [not h for h in hits] == [i in damaged for i in range(16)]
        assert st.damaged_at_open + st.corrupt_pages == len(damaged)
        assert st.free == len(damaged)  # damaged slots are free again
        assert assert_exact(disk, keys) == hits  # a second read counts nothing twice
        assert disk.stats().corrupt_pages == st.corrupt_pages
        disk.check()
    with open_disk(
        tmp_path
    ) as disk:  # found damaged once: cleared, not recovered and counted again
        assert assert_exact(disk, keys) == hits
        assert (disk.stats().corrupt_pages, disk.stats().damaged_at_open) == (0, 0)


def test_torn_writes_mixing_two_pages(tmp_path: Path) -> None:
    """Header of one write with the payload of another (in both orders) is never served."""
    a, b = key(1), key(2)
    with open_disk(tmp_path, slots=4) as disk:
        write_sync(disk, [a])
    f, base = slot_offset(tmp_path, 0, 4, SLOT)
    a_slot = f.read_bytes()[base : base + SLOT]
    with open_disk(tmp_path, slots=4) as disk:
        disk.free([a])
        write_sync(disk, [b])  # reuses slot 0
    b_slot = f.read_bytes()[base : base + SLOT]
    for header, payload, gone in ((a_slot, b_slot, a), (b_slot, a_slot, b)):
        with open(f, "r+b") as fh:
            fh.seek(base)
            fh.write(header[:ALIGN] + payload[ALIGN:])
        with open_disk(tmp_path, slots=4) as disk:
            assert disk.lookup([gone]) == [0]
            assert assert_exact(disk, [a, b]) == [False, False]
            assert disk.stats().corrupt_pages == 1 and disk.stats().free == 4
    # a half-written payload (the first half new, the rest old)
    with open(f, "r+b") as fh:
        fh.seek(base)
        fh.write(b_slot[: ALIGN + PAGE // 2] + a_slot[ALIGN + PAGE // 2 :])
    with open_disk(tmp_path, slots=4) as disk:
        assert assert_exact(disk, [a, b]) == [False, False]
        assert disk.stats().corrupt_pages == 1


def test_truncated_segments(tmp_path: Path) -> None:
    keys = _stored(tmp_path, 8)
    seg1 = tmp_path / "segment-00001.tkvd"
    os.truncate(seg1, SLOT + SLOT // 2)  # slot 4 whole, slot 5 cut in its payload, 6-7 gone
    with open_disk(tmp_path) as disk:
        assert assert_exact(disk, keys) == [True] * 5 + [False] * 3
        assert disk.stats().corrupt_pages == 1
        # truncated under an open handle: short reads, counted
        os.truncate(tmp_path / "segment-00000.tkvd", 0)
        assert assert_exact(disk, keys[:4]) == [False] * 4
        assert disk.stats().corrupt_pages == 5
        assert write_sync(disk, keys[:4]) == [StoreStatus.STORED] * 4  # rewritten, served again
        assert assert_exact(disk, keys[:4]) == [True] * 4
        disk.check()


def _hostile_headers() -> list[bytes]:
    rng = random.Random(3)
    out = [bytes(rng.randrange(256) for _ in range(ALIGN)) for _ in range(4)]
    k = key(99)
    for h in (
        Header(1, k, 5, PAGE, 0, 12345),  # another slot
        Header(1, k, 5, 1 << 31, 0, 1),  # another page size
        Header(1, k, (1 << 64) - 1, PAGE, 0, 2),  # generation at the limit
        Header(1, b"\xff" * 32, 5, PAGE, 0, 3),  # 32-byte key in a 16-byte store
    ):
        buf = bytearray(ALIGN)
        pack_header(memoryview(buf), h, crc32c)
        out.append(bytes(buf))
    broken = bytearray(out[-1])
    broken[12] = 200  # key_len out of range, CRC fixed up: still refused
    out.append(bytes(broken))
    return out


def test_hostile_headers_never_crash(tmp_path: Path) -> None:
    keys = _stored(tmp_path, 16)
    headers = _hostile_headers()
    for slot, raw in enumerate(headers):
        f, base = slot_offset(tmp_path, slot, 4, SLOT)
        with open(f, "r+b") as fh:
            fh.seek(base)
            fh.write(raw)
    with open_disk(tmp_path) as disk:
        st = disk.stats()
        assert st.damaged_at_open == len(headers) and st.recovered == 16 - len(headers)
        assert assert_exact(disk, keys) == [False] * len(headers) + [True] * (16 - len(headers))
        assert disk.lookup([key(99)]) == [None]
        assert write_sync(disk, [key(500)]) == [StoreStatus.STORED]  # generations still fit
        disk.check()


def test_a_valid_header_with_a_wrong_payload(tmp_path: Path) -> None:
    """An intact header naming a key whose payload never was written there: caught by CRC."""
    keys = _stored(tmp_path, 2)
    f, base = slot_offset(tmp_path, 1, 4, SLOT)
    buf = bytearray(ALIGN)
    pack_header(memoryview(buf), Header(1, key(77), 1000, PAGE, 1234, 1), crc32c)
    with open(f, "r+b") as fh:
        fh.seek(base)
        fh.write(buf)
    with open_disk(tmp_path) as disk:
        assert disk.lookup([key(77)]) == [1]
        assert assert_exact(disk, [key(77), *keys]) == [False, True, False]
        assert disk.stats().corrupt_pages == 1


@pytest.mark.parametrize("runs", [4])
def test_kill_9_during_writes_serves_nothing_wrong(tmp_path: Path, runs: int) -> None:
    rng = random.Random(11)
    first = 0
    for _ in range(runs):
        proc = _child("write", str(tmp_path), str(first), "16")
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()  # type: ignore[union-attr]
        with open_disk(tmp_path) as disk:
            found = disk.victims(disk.stats().capacity)  # every key recovered
            assert found, "the child wrote nothing"
            hits = assert_exact(disk, found)
            st = disk.stats()
            assert sum(hits) + st.corrupt_pages == len(found)
            disk.check()
        first += 100_000


def test_two_processes_on_one_path(tmp_path: Path) -> None:
    proc = _child("hold", str(tmp_path))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(DiskInUseError, match=f"pid {proc.pid}"):
            open_disk(tmp_path)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    with open_disk(tmp_path):  # the kernel dropped the dead holder's lock
        pass


def _run_limited(path: Path, limit: int, n: int) -> dict[str, object]:
    proc = _child("limit", str(path), str(limit), str(n))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def test_file_size_limit_fails_stores_counted(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG, as ENOSPC would) mid-run: failed stores are counted, never stored."""
    with open_disk(tmp_path, slots=8, segment_bytes=1 << 20):
        pass
    limit = 3 * SLOT + ALIGN + 100  # slot 3's payload crosses it; slots 4-7 lie beyond
    r = _run_limited(tmp_path, limit, 8)
    status = r["status"]
    assert isinstance(status, list)
    stored = status.count("stored")
    # a write crossing the limit fails whole (O_DIRECT refuses the cut-down count) or in part
    assert 2 <= stored <= 3 and status == ["stored"] * stored + ["failed"] * (8 - stored), r
    assert r["hits"] == [True] * stored + [False] * (8 - stored)
    assert r["write_failures"] == 8 - stored and r["free"] == 8 - stored
    assert "large" in str(r["last_error"]) or "Invalid" in str(r["last_error"])
    with open_disk(tmp_path, slots=8, segment_bytes=1 << 20) as disk:
        assert assert_exact(disk, [key(j) for j in range(8)]) == r["hits"]
        assert disk.stats().corrupt_pages == 0  # the cut writes' headers were cleared


def test_no_room_to_preallocate_creates_nothing(tmp_path: Path) -> None:
    r = _run_limited(tmp_path, 2 * SLOT, 1)
    assert r["error"] == "DiskSpaceError", r
    assert list(tmp_path.iterdir()) == []


def _failing(err: int, short: bool = False) -> object:
    def fake(fd: int, buffers: list[memoryview], offset: int) -> int:
        if short:
            return sum(len(b) for b in buffers) // 2
        raise OSError(err, os.strerror(err))

    return fake


@pytest.mark.parametrize("err, short", [(errno.EIO, False), (errno.ENOSPC, False), (0, True)])
def test_write_errors_never_reported_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, short: bool
) -> None:
    with open_disk(tmp_path, slots=4) as disk:
        write_sync(disk, [key(0)])
        with monkeypatch.context() as m:
            m.setattr(dio.os, "pwritev", _failing(err, short))
            assert write_sync(disk, [key(1), key(2)]) == [StoreStatus.FAILED] * 2
        st = disk.stats()
        assert (st.write_failures, st.used, st.reserved, st.free) == (2, 1, 0, 3)
        assert (os.strerror(err) if err else "short write") in st.last_error
        assert assert_exact(disk, [key(0), key(1), key(2)]) == [True, False, False]
        assert write_sync(disk, [key(1)]) == [StoreStatus.STORED]  # the disk goes on
        disk.check()


def test_read_errors_are_counted_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_disk(tmp_path, slots=4) as disk:
        keys = [key(0), key(1)]
        write_sync(disk, keys)
        with monkeypatch.context() as m:
            m.setattr(dio.os, "preadv", _failing(errno.EIO))
            hits, out = read_sync(disk, keys)
        assert hits == [False, False] and not any(o.any() for o in out)
        st = disk.stats()
        assert (st.read_errors, st.misses, st.used, st.free) == (2, 2, 0, 4)


def test_a_failure_inside_a_batch_function_fails_only_that_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_disk(tmp_path, slots=4) as disk:

        def boom(self: object, items: object, scratch: object) -> object:
            raise MemoryError("injected")

        with monkeypatch.context() as m:
            m.setattr(dio.SlotIO, "write_batch", boom)
            assert write_sync(disk, [key(1)]) == [StoreStatus.FAILED]
        assert disk.stats().free == 4 and "injected" in disk.stats().last_error
        assert write_sync(disk, [key(1)]) == [StoreStatus.STORED]


def test_buffered_mode_survives_the_same_faults(tmp_path: Path) -> None:
    keys = [key(i) for i in range(8)]
    with open_disk(tmp_path, direct=False) as disk:
        write_sync(disk, keys)
    f, base = slot_offset(tmp_path, 2, 4, SLOT)
    flip_bits(f, [(base + ALIGN + 17, 3)])
    with DiskPages.open(
        tmp_path, page_bytes=PAGE, disk_bytes=16 * SLOT, segment_bytes=4 * SLOT, direct=False
    ) as disk:
        hits, out = read_sync(disk, keys)
        assert hits == [True, True, False] + [True] * 5
        assert not out[2].any()  # the damaged bytes read into the caller's buffer were wiped
        assert all(np.array_equal(o, page(k)) for k, o, h in zip(keys, out, hits, strict=True) if h)


@given(raw=st.binary(min_size=0, max_size=HEADER_BYTES + 8))
@settings(max_examples=300)
def test_random_header_bytes_never_crash_the_parser(raw: bytes) -> None:
    h = unpack_header(memoryview(raw), crc32c)
    assert h is None or len(h.key) in (16, 32)


@given(
    flips=st.lists(st.tuples(st.integers(0, HEADER_BYTES - 1), st.integers(0, 7)), min_size=1),
    gen=st.integers(0, (1 << 64) - 1),
    slot=st.integers(0, (1 << 64) - 1),
)
@settings(max_examples=300)
def test_a_damaged_header_is_never_taken_for_another(
    flips: list[tuple[int, int]], gen: int, slot: int
) -> None:
    good = Header(1, key(5), gen, PAGE, 1234, slot)
    buf = bytearray(ALIGN)
    pack_header(memoryview(buf), good, crc32c)
    assert unpack_header(memoryview(buf), crc32c) == good
    for o, b in flips:
        buf[o] ^= 1 << b
    parsed = unpack_header(memoryview(buf), crc32c)
    assert parsed is None or parsed == good  # flips that cancel out leave it intact


def test_a_damaged_page_read_twice_at_once_counts_once(tmp_path: Path) -> None:
    """Regression (found by the long model run): the same key twice in one read counted its
    damage twice."""
    (k,) = _stored(tmp_path, 1)
    f, base = slot_offset(tmp_path, 0, 4, SLOT)
    flip_bits(f, [(base + ALIGN + 5, 0)])
    with open_disk(tmp_path) as disk:
        assert assert_exact(disk, [k, k]) == [False, False]
        assert disk.stats().corrupt_pages == 1 and disk.stats().free == 16
