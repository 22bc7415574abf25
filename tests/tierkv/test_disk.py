"""The disk medium (tierkv.disk.DiskPages): round trips, statuses, restart, configuration errors,
cancellation, leaks."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.disk import (
    DiskClosedError,
    DiskConfigError,
    DiskInUseError,
    DiskLayoutError,
    DiskPages,
    StoreStatus,
)
from tierkv.errors import InvalidInputError, TierKVError

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import (
    PAGE,
    assert_exact,
    key,
    open_disk,
    page,
    read_only_dir,
    read_sync,
    rows,
    write_sync,
)

S = StoreStatus


async def test_round_trip_direct_bit_exact(tmp_path: Path) -> None:
    async with open_disk(tmp_path) as disk:
        assert disk.io_mode == "direct", disk.stats().io_mode_reason
        keys = [key(i) for i in range(10)]
        assert await disk.write(keys, [page(k) for k in keys]) == [S.STORED] * 10
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        assert await disk.read(keys, out) == [True] * 10
        for k, o in zip(keys, out, strict=True):
            assert np.array_equal(o, page(k))
        st = disk.stats()
        assert (st.hits, st.misses, st.pages_written) == (10, 0, 10)
        assert st.bytes_read == st.bytes_written == 10 * PAGE
        assert st.read_latency.count == 1 and st.write_latency.count == 1
        disk.check()


@pytest.mark.parametrize("page_bytes", [PAGE, 5000])
def test_unaligned_and_tensor_buffers(tmp_path: Path, page_bytes: int) -> None:
    """Buffers O_DIRECT cannot use as they are go through the bounce buffer: same bytes."""
    with open_disk(tmp_path, page_bytes=page_bytes) as disk:
        keys = [key(i) for i in range(4)]
        raw = [bytearray(page_bytes + 1) for _ in keys]  # offset by one byte: never aligned
        srcs = [memoryview(r)[1:] for r in raw]
        for s, k in zip(srcs, keys, strict=True):
            s[:] = page(k, page_bytes).tobytes()
        assert disk.submit_write(keys, srcs).result() == [S.STORED] * 4
        dst = [torch.zeros(page_bytes, dtype=torch.uint8) for _ in keys]
        assert disk.submit_read(keys, dst).result() == [True] * 4
        for k, d in zip(keys, dst, strict=True):
            assert np.array_equal(d.numpy(), page(k, page_bytes))


def test_runs_of_adjacent_slots_and_mixed_buffers(tmp_path: Path) -> None:
    """Adjacent slots move in one call; a gap, a bounced buffer or MAX_RUN ends a run."""
    from tierkv.disk.io import MAX_RUN

    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, iov: list[memoryview], off: int) -> int:
        calls.append(len(iov) // 2)
        return real(fd, iov, off)

    n = MAX_RUN + 20
    with open_disk(tmp_path, slots=n, segment_bytes=1 << 30, io_threads=1) as disk:
        keys = [key(i) for i in range(n)]
        assert write_sync(disk, keys) == [S.STORED] * n
        dst = rows(n, PAGE)
        dst[3] = np.zeros(PAGE + 1, np.uint8)[1:]  # unaligned: bounced, alone
        order = keys[:10] + keys[11:] + keys[10:11]  # slot 10 read last: a gap
        dst_order = dst[:10] + dst[11:] + dst[10:11]
        os.preadv = counting  # type: ignore[assignment]
        try:
            assert disk.submit_read(order, dst_order).result() == [True] * n
        finally:
            os.preadv = real  # type: ignore[assignment]
        assert calls == [3, 1, 6, MAX_RUN, n - 11 - MAX_RUN, 1]
        for k, d in zip(order, dst_order, strict=True):
            assert np.array_equal(d, page(k))


def test_slots_of_one_write_ascend_after_frees(tmp_path: Path) -> None:
    """Regression: freed slots came back from the free list in reverse, so a batch written
    after an eviction never formed a run of adjacent slots."""
    with open_disk(tmp_path, slots=8) as disk:
        keys = [key(i) for i in range(8)]
        write_sync(disk, keys)
        disk.free(keys[2:6])
        res = disk.reserve([key(10 + i) for i in range(5)])
        assert [r.slot for r in res] == [2, 3, 4, 5, -1] and res[4].why == "no_room"
        disk.abort(res)
        disk.check()


def test_buffered_on_tmpfs_says_why(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    d = shm / f"tierkv-disk-test-{os.getpid()}"
    d.mkdir()
    try:
        with open_disk(d) as disk:
            st = disk.stats()
            assert st.io_mode == "buffered" and "tmpfs" in st.io_mode_reason
            keys = [key(i) for i in range(3)]
            write_sync(disk, keys)
            assert assert_exact(disk, keys) == [True] * 3
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    with open_disk(tmp_path, direct=False) as disk:
        assert disk.io_mode == "buffered" and "direct=False" in disk.stats().io_mode_reason


def test_statuses_and_room(tmp_path: Path) -> None:
    with open_disk(tmp_path, slots=4) as disk:
        keys = [key(i) for i in range(6)]
        st = write_sync(disk, [keys[0], keys[0], keys[1]])
        assert st == [S.STORED, S.BUSY, S.STORED]
        assert write_sync(disk, keys[1:]) == [S.PRESENT, S.STORED, S.STORED, S.NO_ROOM, S.NO_ROOM]
        assert disk.stats().no_room == 2
        assert disk.lookup([keys[5], keys[0]])[0] is None
        # LRU: reading keys[0] makes it the most recent
        read_sync(disk, [keys[0]])
        assert disk.victims(2) == [keys[1], keys[2]]
        assert disk.free(disk.victims(2)) == 2
        assert disk.free([keys[1]]) == 0
        assert write_sync(disk, keys[4:]) == [S.STORED, S.STORED]
        assert assert_exact(disk, keys) == [True, False, False, True, True, True]
        disk.check()


def test_two_phase_reserve_commit_abort(tmp_path: Path) -> None:
    with open_disk(tmp_path, slots=4) as disk:
        keys = [key(i) for i in range(3)]
        res = disk.reserve(keys)
        assert [r.slot >= 0 for r in res] == [True] * 3
        assert disk.stats().reserved == 3
        ok = disk.submit_store(res[:2], [page(k) for k in keys[:2]]).result()
        assert ok == [True, True]
        assert disk.lookup(keys) == [None] * 3  # written, not committed
        disk.commit(res[:2], ok)
        disk.abort(res[2:])
        assert disk.stats().reserved == 0 and disk.stats().free == 2
        assert assert_exact(disk, keys) == [True, True, False]
        disk.check()


def test_reopen_recovers_content_pages_only(tmp_path: Path) -> None:
    content = [key(i) for i in range(5)]
    private = [key(100 + i, private=True) for i in range(3)]
    with open_disk(tmp_path) as disk:
        write_sync(disk, content + private)
        disk.free([content[4]])  # evicted, but its bytes stay: it may come back, verified
    with open_disk(tmp_path) as disk:
        assert disk.lookup(private) == [None] * 3
        hits = assert_exact(disk, content + private)
        assert hits[:4] == [True] * 4 and hits[5:] == [False] * 3
        assert disk.stats().free == 16 - sum(hits)
        # generations go on increasing: a key written now outranks any stale copy
        disk.free(content[:1])
        write_sync(disk, content[:1])
    with open_disk(tmp_path) as disk:
        assert assert_exact(disk, content[:1]) == [True]
        disk.check()


def test_explicit_persistent_flags(tmp_path: Path) -> None:
    keys = [key(i) for i in range(2)]
    with open_disk(tmp_path) as disk:
        write_sync(disk, keys, persistent=[False, True])
    with open_disk(tmp_path) as disk:
        assert disk.lookup(keys)[0] is None and disk.lookup(keys)[1] is not None


def _listing(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"disk_bytes": 4096}, "holds no page"),
        ({"disk_bytes": 0}, "positive"),
        ({"page_bytes": -1}, "positive"),
        ({"page_bytes": 1.5}, "positive"),
        ({"key_bytes": 20}, "key_bytes"),
        ({"io_threads": 0}, "io_threads"),
        ({"segment_bytes": True}, "positive"),
    ],
)
def test_bad_sizes_create_nothing(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"page_bytes": PAGE, "disk_bytes": 1 << 20}
    args.update(kw)
    with pytest.raises(DiskConfigError, match=match):
        DiskPages.open(tmp_path, **args)  # type: ignore[arg-type]
    assert _listing(tmp_path) == []


def test_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(DiskConfigError, match="does not exist"):
        open_disk(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DiskConfigError, match="not a directory"):
        open_disk(tmp_path / "file")
    ro = read_only_dir(tmp_path)
    before = _listing(ro)
    with pytest.raises(DiskConfigError, match="read-only") as info:
        open_disk(ro, overwrite=True)  # (as root: sysfs, a folder of other files)
    assert isinstance(info.value, (TierKVError, ValueError))
    assert _listing(ro) == before


def test_other_layout_refused_and_kept(tmp_path: Path) -> None:
    keys = [key(i) for i in range(3)]
    with open_disk(tmp_path) as disk:
        write_sync(disk, keys)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "lock"}
    with pytest.raises(DiskLayoutError, match="page_bytes"):
        open_disk(tmp_path, page_bytes=2 * PAGE)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "lock"} == before
    (tmp_path / "layout.json").write_text("{not json")
    with pytest.raises(DiskLayoutError, match="not a tierkv disk layout"):
        open_disk(tmp_path)


def test_capacity_change_keeps_what_fits(tmp_path: Path) -> None:
    keys = [key(i) for i in range(12)]
    with open_disk(tmp_path, slots=16) as disk:
        write_sync(disk, keys)
    with open_disk(tmp_path, slots=8) as disk:  # the last segments shrink away
        assert disk.stats().capacity == 8
        assert sum(assert_exact(disk, keys)) == 8
    with open_disk(tmp_path, slots=16) as disk:
        assert sum(assert_exact(disk, keys)) == 8
        disk.check()


def test_second_open_of_a_path_in_use(tmp_path: Path) -> None:
    with open_disk(tmp_path):
        with pytest.raises(DiskInUseError, match=f"pid {os.getpid()}"):
            open_disk(tmp_path)
        assert (tmp_path / "lock").exists()  # the holder's lock file is left alone
    with open_disk(tmp_path):
        pass


def test_bad_arguments_change_nothing(tmp_path: Path) -> None:
    with open_disk(tmp_path) as disk:
        k = key(1)
        for keys, bufs in (
            ([b"short"], [page(k)]),
            ([k], [page(k)[:100]]),
            ([k], []),
            ([k], [object()]),
            ([k, key(2)], [page(k), page(k)[::2]]),
        ):
            with pytest.raises(InvalidInputError):
                disk.submit_write(keys, bufs)
            with pytest.raises(InvalidInputError):
                disk.submit_read(keys, bufs)
        with pytest.raises(InvalidInputError, match="writable"):
            disk.submit_read([k], [page(k).tobytes()])
        with pytest.raises(InvalidInputError):
            disk.submit_read(k, [page(k)])  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="persistent"):
            disk.submit_write([k], [page(k)], persistent=[True, False])
        st = disk.stats()
        assert (st.used, st.reserved, st.free, st.pages_written, st.hits + st.misses) == (
            0,
            0,
            16,
            0,
            0,
        )
        disk.check()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_leaks_nothing(tmp_path: Path) -> None:
    fds, threads = _fds(), threading.active_count()
    disk = open_disk(tmp_path)
    write_sync(disk, [key(1)])
    read_sync(disk, [key(1)])
    disk.close()
    disk.close()
    assert _fds() == fds and threading.active_count() == threads
    with pytest.raises(DiskClosedError):
        read_sync(disk, [key(1)])
    with pytest.raises(DiskClosedError):
        write_sync(disk, [key(2)])
    # a failed open leaks nothing either
    with open_disk(tmp_path):
        fds = _fds()
        with pytest.raises(DiskInUseError):
            open_disk(tmp_path)
        assert _fds() == fds


def test_a_failed_scan_leaks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an open that failed in the scan left its I/O threads running."""
    import tierkv.disk.io as dio

    def boom(*args: object) -> object:
        raise MemoryError("injected")

    fds, threads = _fds(), threading.active_count()
    monkeypatch.setattr(dio.SlotIO, "scan", boom)
    with pytest.raises(MemoryError):
        open_disk(tmp_path)
    assert _fds() == fds and threading.active_count() == threads
    assert _listing(tmp_path) == []


async def test_cancelled_awaits_leave_nothing_half_done(tmp_path: Path) -> None:
    async with open_disk(tmp_path, slots=64) as disk:
        keys = [key(i) for i in range(64)]
        task = asyncio.ensure_future(disk.write(keys, [page(k) for k in keys]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        st = disk.stats()
        assert st.reserved == 0 and st.used + st.free == 64  # every write committed or returned
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        task2 = asyncio.ensure_future(disk.read(keys, out))
        await asyncio.sleep(0)
        task2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task2
        snapshot = [o.copy() for o in out]  # nothing writes into the buffers any more
        await asyncio.sleep(0.01)
        assert all(np.array_equal(a, b) for a, b in zip(out, snapshot, strict=True))
        assert disk.victims(64) and disk.stats().used == st.used  # reads unpinned
        assert sum(assert_exact(disk, keys)) == st.used
        disk.check()


def test_free_during_read_defers_the_slot(tmp_path: Path) -> None:
    with open_disk(tmp_path, slots=2) as disk:
        a, b, c = key(1), key(2), key(3)
        write_sync(disk, [a, b])
        gate = threading.Event()
        import tierkv.disk.io as dio

        real = dio.SlotIO.read_batch

        def slow(self: dio.SlotIO, items: object, scratch: object) -> object:
            gate.wait(5)
            return real(self, items, scratch)  # type: ignore[arg-type]

        dio.SlotIO.read_batch = slow  # type: ignore[method-assign]
        try:
            out = [np.zeros(PAGE, np.uint8)]
            fut = disk.submit_read([a], out)
            assert disk.free([a]) == 1
            assert write_sync(disk, [c]) == [S.NO_ROOM]  # a's slot is still being read
            gate.set()
            assert fut.result() == [True] and np.array_equal(out[0], page(a))
        finally:
            dio.SlotIO.read_batch = real  # type: ignore[method-assign]
        assert write_sync(disk, [c]) == [S.STORED]
        assert assert_exact(disk, [a, b, c]) == [False, True, True]
        disk.check()


async def test_engine_jobs_move_pages_between_a_host_arena_and_disk(tmp_path: Path) -> None:
    from tierkv.disk.jobs import submit_load, submit_save
    from tierkv.runtime import TransferEngine, create_backend

    backend = create_backend("cpu")
    host = backend.create_arena("host", slot_bytes=PAGE, num_slots=8, kind="pinned")
    ids = [int(i) for i in host.allocate(8)]
    keys = [key(i) for i in range(4)]
    for k, i in zip(keys, ids[:4], strict=True):
        host.array[i] = page(k)
    async with open_disk(tmp_path) as disk, TransferEngine(backend) as engine:
        saved = submit_save(engine, disk, keys, host, ids[:4])
        assert host.is_busy(ids[:4])  # pinned while the job runs
        await saved
        assert saved.result() == [S.STORED] * 4
        loaded = submit_load(engine, disk, [*keys, key(9)], host, ids[3:8])
        await loaded
        assert loaded.result() == [True] * 4 + [False]
        for k, i in zip(keys, ids[3:7], strict=True):
            assert np.array_equal(host.array[i], page(k))
        assert not host.is_busy(ids)
        with pytest.raises(InvalidInputError):
            submit_load(engine, disk, keys, host, ids[:3])
        other = backend.create_arena("other", slot_bytes=2 * PAGE, num_slots=1, kind="pinned")
        with pytest.raises(InvalidInputError, match="slots"):
            submit_load(engine, disk, keys[:1], other, [0])
