"""Small cpu copies run on the submitting thread when the engine is idle (issue 26): done when
submit returns, bit-exact, counted as any other batch; never ahead of queued work."""

from __future__ import annotations

import threading

import numpy as np

from tierkv.runtime import CpuBackend, TransferEngine


def _arenas(backend: CpuBackend, slots: int = 16, slot_bytes: int = 4096):  # type: ignore[no-untyped-def]
    a = backend.create_arena("a", slot_bytes=slot_bytes, num_slots=slots)
    b = backend.create_arena("b", slot_bytes=slot_bytes, num_slots=slots)
    return a, b, a.allocate(slots), b.allocate(slots)


async def test_small_copy_runs_inline_and_exact(backend: CpuBackend) -> None:
    a, b, ia, ib = _arenas(backend)
    data = np.random.default_rng(0).integers(0, 256, (4, a.slot_bytes), np.uint8)
    a.array[ia[:4]] = data
    async with TransferEngine(backend, inline_bytes=4 * a.slot_bytes) as engine:
        h = engine.submit(a, ia[:4], b, ib[:4])
        assert h.done() and h.state == "done"  # no stream thread was needed
        assert np.array_equal(b.array[ib[:4]], data)
        await h.wait(timeout=5)
        assert engine.stats.completed == 1 and engine.inflight == 0
        big = engine.submit(a, ia[:5], b, ib[4:9])  # over the limit: a stream's batch
        await big.wait(timeout=5)
        assert np.array_equal(b.array[ib[4:9]], a.array[ia[:5]])
        assert engine.stats.completed == 2


async def test_no_inline_copy_overtakes_queued_work(backend: CpuBackend) -> None:
    a, b, ia, ib = _arenas(backend)
    async with TransferEngine(backend, max_inflight=1, inline_bytes=1 << 20) as engine:
        gate = threading.Event()
        first = engine.submit_call(a, ia[:1], b, ib[:1], lambda: gate.wait(10))
        later = engine.submit(a, ia[1:2], b, ib[1:2])  # the engine is busy: queued
        assert not later.done() and engine.pending == 1
        gate.set()
        await first.wait(timeout=10)
        await later.wait(timeout=10)
        assert later.stats.started_at >= first.stats.finished_at


async def test_off_by_default(backend: CpuBackend) -> None:
    a, b, ia, ib = _arenas(backend)
    async with TransferEngine(backend) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        h = engine.submit(a, ia[:1], b, ib[:1])
        assert not h.done()  # behind the stream's work, as before
        gate.set()
        await h.wait(timeout=10)
