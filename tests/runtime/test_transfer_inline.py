"""Small cpu copies run on the submitting thread when the engine is idle (issue 26): done when
submit returns, bit-exact, counted as any other batch; never ahead of queued work."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tierkv.runtime import CpuBackend, TransferEngine, TransferError
from tierkv.runtime.errors import InvalidSlotError


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


async def test_copy_now_copies_here_or_does_nothing(backend: CpuBackend) -> None:
    a, b, ia, ib = _arenas(backend)
    data = np.random.default_rng(1).integers(0, 256, (3, a.slot_bytes), np.uint8)
    a.array[ia[:3]] = data
    async with TransferEngine(backend, max_inflight=1, inline_bytes=4 * a.slot_bytes) as engine:
        assert engine.runs_inline(4 * a.slot_bytes) and not engine.runs_inline(5 * a.slot_bytes)
        st = engine.copy_now(a, ia[:3], b, ib[:3])
        assert st is not None and st.pages == 3 and st.finished_at >= st.started_at > 0
        assert np.array_equal(b.array[ib[:3]], data)
        assert engine.stats.completed == 1 and engine.inflight == 0
        assert not a.is_busy(ia[:3]) and not b.is_busy(ib[:3])
        assert engine.copy_now(a, ia[:5], b, ib[:5]) is None  # over the limit: nothing done
        before = b.array[ib[8:9]].copy()
        gate = threading.Event()
        first = engine.submit_call(a, ia[:1], b, ib[:1], lambda: gate.wait(10))
        assert not engine.runs_inline(a.slot_bytes)
        assert engine.copy_now(a, ia[8:9], b, ib[8:9]) is None  # the engine is busy
        assert np.array_equal(b.array[ib[8:9]], before) and not b.is_busy(ib[8:9])
        gate.set()
        await first.wait(timeout=10)
        assert engine.stats.completed == 2 and engine.stats.submitted == 2


async def test_copy_now_bad_slots_or_a_failing_copy_leave_nothing_busy(
    backend: CpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, ia, ib = _arenas(backend)
    async with TransferEngine(backend, inline_bytes=1 << 20) as engine:
        with pytest.raises(InvalidSlotError):
            engine.copy_now(a, [0, 1], b, [2])
        with pytest.raises(InvalidSlotError):
            engine.copy_now(a, [0], b, [99])
        assert engine.stats.submitted == 0

        def broken(*args: object) -> object:
            raise OSError("disk on fire")

        monkeypatch.setattr(backend, "copy_slots", broken)
        with pytest.raises(TransferError, match="disk on fire"):
            engine.copy_now(a, ia[:2], b, ib[:2])
        assert engine.stats.failed == 1 and engine.inflight == 0
        assert not a.is_busy(ia[:2]) and not b.is_busy(ib[:2])
