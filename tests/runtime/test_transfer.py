from __future__ import annotations

import threading

import numpy as np
import pytest

from tierkv.runtime import (
    Arena,
    CpuBackend,
    EngineClosedError,
    Priority,
    TransferCancelledError,
    TransferEngine,
    TransferError,
)
from tierkv.runtime.cpu_copy import native_kernel
from tierkv.runtime.errors import ArenaMismatchError, InvalidSlotError, SlotBusyError


def fill_random(arena: Arena, ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """Write random bytes into slots `ids`; returns what was written."""
    data = np.random.default_rng(seed).integers(0, 256, (len(ids), arena.slot_bytes), np.uint8)
    arena.array[ids] = data
    return data


PATTERNS = {
    "adjacent": lambda n, rng: (np.arange(n), np.arange(n) + 3),
    "reversed": lambda n, rng: (np.arange(n)[::-1], np.arange(n) + 1),
    "random": lambda n, rng: (rng.permutation(40)[:n], rng.permutation(40)[:n]),
    "mixed runs": lambda n, rng: (
        np.r_[np.arange(5), np.arange(20, 20 + n - 5)][:n],
        np.r_[np.arange(30, 35), rng.permutation(25)[: n - 5]][:n],
    ),
    "single": lambda n, rng: (np.array([7]), np.array([0])),
}


@pytest.mark.parametrize("kernel", ["auto", "native", "runs", "staged"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
async def test_round_trip_is_bit_exact(pattern: str, kernel: str) -> None:
    if kernel == "native" and native_kernel() is None:
        pytest.skip("no C compiler: the native copy kernel is unavailable")
    backend = CpuBackend(kernel=kernel)
    rng = np.random.default_rng(1)
    src = backend.create_arena("src", slot_bytes=4096, num_slots=40)
    dst = backend.create_arena("dst", slot_bytes=4096, num_slots=40)
    src.allocate(40)
    dst.allocate(40)
    s_ids, d_ids = (np.asarray(x) for x in PATTERNS[pattern](12, rng))
    data = fill_random(src, s_ids, seed=2)
    untouched = np.setdiff1d(np.arange(40), d_ids)
    before = dst.array[untouched].copy()
    # a small staging buffer forces several chunks through the staged kernel
    async with TransferEngine(backend, max_inflight=2, staging_bytes=3 * 4096) as engine:
        stats = await engine.submit(src, s_ids, dst, d_ids, priority=Priority.DEMAND)
        back = src.allocate(0)  # nothing to allocate: all slots are in use
        assert back.size == 0
        await engine.submit(dst, d_ids, src, s_ids)  # and back again
    assert np.array_equal(dst.array[d_ids], data)
    assert np.array_equal(src.array[s_ids], data)
    assert np.array_equal(dst.array[untouched], before)
    assert stats.pages == len(s_ids) and stats.bytes == len(s_ids) * 4096
    assert stats.copy_s >= 0 and stats.queue_wait_s >= 0 and stats.runs >= 1
    backend.close()


async def test_load_waits_for_the_write_it_depends_on(backend: CpuBackend) -> None:
    """A write on stream A is held back; a load on stream B after its event must see its bytes."""
    dev = backend.create_arena("dev", slot_bytes=1024, num_slots=8)
    host = backend.create_arena("host", slot_bytes=1024, num_slots=8)
    other = backend.create_arena("other", slot_bytes=1024, num_slots=8)
    d, h, o = dev.allocate(4), host.allocate(4), other.allocate(4)
    data = fill_random(dev, d, seed=3)
    async with TransferEngine(backend) as engine:
        gate = threading.Event()
        engine.stream(dev, host).enqueue(lambda: gate.wait(10))  # makes the write slow
        write = engine.submit(dev, d, host, h, priority=Priority.WRITEBACK)
        load = engine.submit(host, h, other, o, priority=Priority.DEMAND, after=[write])
        assert not load.done()
        gate.set()
        await load
        assert write.done()
        assert write.stats.finished_at <= load.stats.started_at
    assert np.array_equal(other.array[o], data)


async def test_priorities_and_bounded_inflight(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=256, num_slots=64)
    b = backend.create_arena("b", slot_bytes=256, num_slots=64)
    ids_a, ids_b = a.allocate(64), b.allocate(64)
    async with TransferEngine(backend, max_inflight=2) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        first = [engine.submit(a, ids_a[i : i + 1], b, ids_b[i : i + 1]) for i in range(2)]
        order = [Priority.WRITEBACK, Priority.PREFETCH, Priority.DEMAND, Priority.WRITEBACK]
        queued = [
            engine.submit(a, ids_a[i : i + 1], b, ids_b[i : i + 1], priority=p)
            for i, p in enumerate(order, start=2)
        ]
        assert engine.inflight == 2 and engine.pending == 4
        gate.set()
        for h in first + queued:
            await h.wait(timeout=10)
        starts = sorted(queued, key=lambda h: h.stats.started_at)
        assert [h.priority for h in starts] == sorted(order)
        assert engine.stats.max_inflight_seen == 2
        assert engine.stats.completed == 6


async def test_dependency_inherits_priority(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=8)
    b = backend.create_arena("b", slot_bytes=64, num_slots=8)
    ia, ib = a.allocate(8), b.allocate(8)
    async with TransferEngine(backend, max_inflight=1) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        engine.submit(a, ia[:1], b, ib[:1])  # occupies the single in-flight place
        wb = engine.submit(a, ia[1:2], b, ib[1:2], priority=Priority.WRITEBACK)
        pf = engine.submit(a, ia[2:3], b, ib[2:3], priority=Priority.PREFETCH)
        demand = engine.submit(b, ib[1:2], a, ia[3:4], priority=Priority.DEMAND, after=[wb])
        assert wb.priority is Priority.DEMAND
        gate.set()
        await demand.wait(timeout=10)
        await pf.wait(timeout=10)
        assert wb.stats.started_at < pf.stats.started_at


async def test_bad_inputs_raise_and_change_nothing(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=8)
    b = backend.create_arena("b", slot_bytes=64, num_slots=8)
    c = backend.create_arena("c", slot_bytes=32, num_slots=8)
    ia, ib = a.allocate(4), b.allocate(4)
    async with TransferEngine(backend) as engine:
        bad_calls = [
            (ArenaMismatchError, (a, ia, c, [0, 1, 2, 3])),
            (InvalidSlotError, (a, ia, b, ib[:3])),  # length mismatch
            (InvalidSlotError, (a, ia[:2], b, [ib[0], ib[0]])),  # duplicated destination
            (InvalidSlotError, (a, [0], b, [99])),  # out of range
            (InvalidSlotError, (a, np.array([0.0]), b, [0])),  # wrong dtype
            (InvalidSlotError, (a, [[0]], b, [[0]])),  # wrong shape
            (InvalidSlotError, (a, [5], b, [0])),  # source slot not allocated
            (InvalidSlotError, (a, [0], b, [6])),  # destination slot not allocated
            (InvalidSlotError, (a, [0, 1], a, [1, 2])),  # slot read and written
        ]
        for exc, args in bad_calls:
            with pytest.raises(exc):
                engine.submit(*args)
        assert engine.stats.submitted == 0 and engine.pending == 0
        assert not a.is_busy(ia) and not b.is_busy(ib)
        a.free(ia)  # nothing was left busy
        b.free(ib)


async def test_busy_slots_cannot_be_freed_until_done(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=4)
    b = backend.create_arena("b", slot_bytes=64, num_slots=4)
    ia, ib = a.allocate(2), b.allocate(2)
    async with TransferEngine(backend) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        h = engine.submit(a, ia, b, ib)
        with pytest.raises(SlotBusyError):
            b.free(ib)
        with pytest.raises(SlotBusyError):
            a.free(ia)
        assert b.is_allocated(ib) and a.is_allocated(ia)
        freed = threading.Event()
        h.add_done_callback(lambda _h: (b.free(ib), freed.set()))
        gate.set()
        await h
        assert freed.wait(10) and b.num_free == 4


async def test_cancel_drops_only_pending_batches(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=4)
    b = backend.create_arena("b", slot_bytes=64, num_slots=4)
    ia, ib = a.allocate(2), b.allocate(2)
    engine = TransferEngine(backend, max_inflight=1)
    gate = threading.Event()
    engine.stream(a, b).enqueue(lambda: gate.wait(10))
    running = engine.submit(a, ia[:1], b, ib[:1])
    queued = engine.submit(a, ia[1:], b, ib[1:])
    dependent = engine.submit(b, ib[1:], a, ia[:1], after=[queued])
    assert queued.cancel() and not running.cancel()
    assert queued.state == "cancelled" and not a.is_busy(ia[1:])
    with pytest.raises(TransferCancelledError):
        await queued
    gate.set()
    await running
    with pytest.raises(TransferError):  # what it depended on never happened
        await dependent
    await engine.aclose()
    assert engine.stats.cancelled == 1 and engine.stats.failed == 1


async def test_use_after_close_and_close_drains(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=4)
    b = backend.create_arena("b", slot_bytes=64, num_slots=4)
    ia, ib = a.allocate(4), b.allocate(4)
    engine = TransferEngine(backend, max_inflight=1)
    handles = [engine.submit(a, ia[i : i + 1], b, ib[i : i + 1]) for i in range(4)]
    await engine.aclose(timeout=10)
    assert all(h.state == "done" for h in handles)
    with pytest.raises(EngineClosedError):
        engine.submit(a, ia, b, ib)
    with pytest.raises(EngineClosedError):
        engine.stream(a, b)
    await engine.aclose()  # idempotent


def test_sync_callers(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=128, num_slots=4)
    b = backend.create_arena("b", slot_bytes=128, num_slots=4)
    ia, ib = a.allocate(4), b.allocate(4)
    data = fill_random(a, ia, seed=9)
    with TransferEngine(backend) as engine:
        stats = engine.submit(a, ia, b, ib).synchronize(timeout=10)
    assert stats.bytes == 512 and np.array_equal(b.array[ib], data)


# -- job kinds: host functions (codecs) and async jobs (remote peers) ---------------------------
async def test_call_jobs_share_priorities_bounds_and_stats(backend: CpuBackend) -> None:
    host = backend.create_arena("host", slot_bytes=256, num_slots=8)
    cold = backend.create_arena("cold", slot_bytes=64, num_slots=8)  # another slot size
    ih, ic = host.allocate(8), cold.allocate(8)
    fill_random(host, ih, seed=3)
    ran: list[int] = []

    def encode(i: int) -> int:
        cold.array[ic[i]] = host.array[ih[i]][:64]  # a "codec": the first quarter
        ran.append(i)
        return i * 10

    async with TransferEngine(backend, max_inflight=1) as engine:
        gate = threading.Event()
        engine.stream(host, cold).enqueue(lambda: gate.wait(10))
        first = engine.submit_call(host, ih[:1], cold, ic[:1], lambda: encode(0))
        late = engine.submit_call(
            host, ih[1:2], cold, ic[1:2], lambda: encode(1), priority=Priority.WRITEBACK
        )
        soon = engine.submit_call(
            host, ih[2:3], cold, ic[2:3], lambda: encode(2), priority=Priority.DEMAND
        )
        assert engine.inflight == 1 and engine.pending == 2  # bounded like copies
        assert host.is_busy(ih[1:2]) and cold.is_busy(ic[2:3])  # its slots are busy
        gate.set()
        for h in (first, late, soon):
            await h.wait(timeout=10)
        assert ran == [0, 2, 1]  # by priority
        assert soon.result() == 20 and soon.stats.kind == "call" and soon.stats.pages == 1
        assert np.array_equal(cold.array[ic[2]], host.array[ih[2]][:64])
        assert not host.is_busy(ih) and not cold.is_busy(ic)
        assert engine.stats.by_kind == {"call": 3}


async def test_a_failing_call_job_fails_its_handle_and_a_pending_one_can_be_dropped(
    backend: CpuBackend,
) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=4)
    b = backend.create_arena("b", slot_bytes=32, num_slots=4)
    ia, ib = a.allocate(4), b.allocate(4)

    def boom() -> None:
        raise ValueError("codec fault")

    async with TransferEngine(backend, max_inflight=1) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        bad = engine.submit_call(a, ia[:1], b, ib[:1], boom)
        dropped = engine.submit_call(a, ia[1:2], b, ib[1:2], lambda: None)
        assert dropped.cancel()
        gate.set()
        with pytest.raises(TransferError, match="codec fault") as info:
            await bad
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(TransferCancelledError):
            await dropped
    assert engine.stats.failed == 1 and engine.stats.cancelled == 1


async def test_async_jobs_run_on_the_loop_in_their_own_lane(backend: CpuBackend) -> None:
    import asyncio

    host = backend.create_arena("host", slot_bytes=64, num_slots=8)
    ih = host.allocate(8)
    release = asyncio.Event()
    started: list[int] = []

    async def peer_read(i: int) -> int:  # a remote peer writing host slot i
        started.append(i)
        await release.wait()
        host.array[ih[i]] = i
        return 1

    async with TransferEngine(backend, max_inflight=1, max_external=1) as engine:
        jobs = [
            engine.submit_async(host, [], host, ih[i : i + 1], lambda i=i: peer_read(i))
            for i in range(2)
        ]
        urgent = engine.submit_async(
            host, [], host, ih[2:3], lambda: peer_read(2), priority=Priority.DEMAND
        )
        # the copy lane is not held by the async one: a copy runs while the peers wait
        copy = engine.submit(host, ih[5:6], host, ih[6:7])
        await copy.wait(timeout=10)
        await asyncio.sleep(0)
        assert started == [0] and engine.pending == 2  # bounded by max_external
        release.set()
        for h in [*jobs, urgent]:
            assert await h.wait(timeout=10) and h.result() == 1
        assert started == [0, 2, 1]  # by priority
        assert all(h.stats.kind == "async" for h in jobs)
        assert (host.array[ih[:3]] == np.arange(3)[:, None]).all()
        assert engine.stats.by_kind == {"async": 3, "copy": 1}


async def test_aclose_cancelling_stops_a_running_async_job(backend: CpuBackend) -> None:
    import asyncio

    host = backend.create_arena("host", slot_bytes=64, num_slots=2)
    ih = host.allocate(2)
    engine = TransferEngine(backend)
    never = engine.submit_async(host, [], host, ih[:1], lambda: asyncio.sleep(3600))
    await asyncio.sleep(0)
    assert never.state == "running"
    await engine.aclose(timeout=10, cancel_pending=True)
    with pytest.raises(TransferCancelledError):
        await never
    assert engine.stats.cancelled == 1


async def test_handed_over_slots_are_the_owners(backend: CpuBackend) -> None:
    a = backend.create_arena("a", slot_bytes=64, num_slots=4)
    b = backend.create_arena("b", slot_bytes=64, num_slots=4)
    a.hand_over()
    b.hand_over()
    assert a.handed_over and a.num_free == 0 and a.num_used == 4
    async with TransferEngine(backend) as engine:  # no allocate: every slot is the owner's
        data = fill_random(a, np.arange(4), seed=5)
        await engine.submit(a, [0, 1, 2, 3], b, [3, 2, 1, 0])
        assert np.array_equal(b.array[::-1], data)
