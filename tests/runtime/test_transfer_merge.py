"""Write-backs queued back to back on a cpu stream run as one kernel call (TransferEngine
merging); loads are never merged (a merged group completes at once: the first load would land
when the last does)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from tierkv.runtime import Arena, CpuBackend, Priority, TransferEngine, TransferError
from tierkv.runtime.backend import CopyInfo
from tierkv.runtime.cpu_stream import CpuStream
from tierkv.runtime.errors import RuntimeEngineError
from tierkv.runtime.freelist import SlotIds
from tierkv.runtime.transfer import MERGE_MAX_BYTES

WB = Priority.WRITEBACK  # the only priority whose copies merge


class CountingBackend(CpuBackend):
    """Records the batch size of every kernel call; fails any call that reads slot `poison`."""

    def __init__(self, poison: int = -1) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.poison = poison

    def copy_slots(
        self, src: Arena, src_ids: SlotIds, dst: Arena, dst_ids: SlotIds, staging: Any
    ) -> CopyInfo:
        self.calls.append(int(src_ids.size))
        if self.poison in src_ids.tolist():
            raise OSError(f"cannot read slot {self.poison}")
        return super().copy_slots(src, src_ids, dst, dst_ids, staging)


def arenas(backend: CpuBackend, slot_bytes: int = 256, n: int = 64) -> tuple[Arena, Arena]:
    a = backend.create_arena("a", slot_bytes=slot_bytes, num_slots=n)
    b = backend.create_arena("b", slot_bytes=slot_bytes, num_slots=n)
    a.allocate(n)
    b.allocate(n)
    a.array[:] = np.random.default_rng(0).integers(0, 256, a.array.shape, np.uint8)
    return a, b


async def test_queued_copies_merge_into_one_call_bit_exact() -> None:
    backend = CountingBackend()
    a, b = arenas(backend)
    rng = np.random.default_rng(1)
    src, dst = rng.permutation(64)[:40], rng.permutation(64)[:40]
    async with TransferEngine(backend, max_inflight=8) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        batches = [(src[i : i + 8], dst[i : i + 8]) for i in range(0, 40, 8)]
        handles = [engine.submit(a, s_, b, d_, priority=WB) for s_, d_ in batches]
        gate.set()
        for h in handles:
            await h.wait(timeout=10)
    assert backend.calls == [40]  # five batches of 8, one call
    assert np.array_equal(b.array[dst], a.array[src])
    assert len({(h.stats.kernel, h.stats.started_at) for h in handles}) == 1
    assert engine.stats.completed == 5 and engine.stats.pages == 40
    backend.close()


@pytest.mark.parametrize("priority", [Priority.DEMAND, Priority.PREFETCH])
async def test_loads_are_never_merged(priority: Priority) -> None:
    backend = CountingBackend()
    a, b = arenas(backend)
    async with TransferEngine(backend, max_inflight=8) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        handles = [engine.submit(a, [i], b, [i], priority=priority) for i in range(5)]
        gate.set()
        for h in handles:
            await h.wait(timeout=10)
    assert backend.calls == [1, 1, 1, 1, 1]  # each load lands on its own
    assert np.array_equal(b.array[:5], a.array[:5])
    backend.close()


async def test_merging_stops_at_a_priority_change_a_wait_and_the_byte_cap() -> None:
    backend = CountingBackend()
    slot = MERGE_MAX_BYTES // 4
    a, b = arenas(backend, slot_bytes=slot, n=16)
    async with TransferEngine(backend, max_inflight=16) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        h = [
            engine.submit(a, [0], b, [0], priority=Priority.PREFETCH),
            engine.submit(a, [1], b, [1], priority=WB),  # not with the prefetch
            engine.submit(a, [2, 3], b, [2, 3], priority=WB),
            engine.submit(a, [4], b, [4], priority=WB),  # the cap: 4 slots
            engine.submit(a, [5], b, [5], priority=WB),
        ]
        other = engine.submit(b, [9], a, [9], priority=WB)  # another stream
        h.append(engine.submit(a, [6], b, [6], after=[other], priority=WB))  # a wait ends it
        gate.set()
        for x in h:
            await x.wait(timeout=10)
    assert backend.calls[0] == 1  # the prefetch alone
    # [1..4] merged (4 slots: the cap); [5], the other stream's [9] and [6] alone
    assert sorted(backend.calls[1:]) == [1, 1, 1, 4]
    assert np.array_equal(b.array[:7], a.array[:7])
    backend.close()


async def test_a_repeated_destination_is_copied_one_batch_at_a_time_in_order() -> None:
    backend = CountingBackend()
    a, b = arenas(backend)
    async with TransferEngine(backend, max_inflight=4) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        first = engine.submit(a, [1, 2], b, [5, 6], priority=WB)
        second = engine.submit(a, [3, 4], b, [6, 7], priority=WB)  # slot 6 written twice
        gate.set()
        await first.wait(timeout=10)
        await second.wait(timeout=10)
    assert backend.calls == [2, 2]
    assert np.array_equal(b.array[[5, 6, 7]], a.array[[1, 3, 4]])  # the later write wins
    backend.close()


async def test_a_failed_merged_call_fails_only_the_batch_at_fault() -> None:
    backend = CountingBackend(poison=9)
    a, b = arenas(backend)
    async with TransferEngine(backend, max_inflight=4) as engine:
        gate = threading.Event()
        engine.stream(a, b).enqueue(lambda: gate.wait(10))
        good = engine.submit(a, [1, 2], b, [1, 2], priority=WB)
        bad = engine.submit(a, [9], b, [9], priority=WB)
        after = engine.submit(a, [3], b, [3], priority=WB)
        gate.set()
        await good.wait(timeout=10)
        with pytest.raises(TransferError, match="cannot read slot 9"):
            await bad.wait(timeout=10)
        await after.wait(timeout=10)
        assert (good.state, bad.state, after.state) == ("done", "failed", "done")
        assert not (a.is_busy([1, 2, 3, 9]) or b.is_busy([1, 2, 3, 9]))
    assert backend.calls == [4, 2, 1, 1]  # merged, then one by one
    assert np.array_equal(b.array[[1, 2, 3]], a.array[[1, 2, 3]])
    assert engine.stats.failed == 1 and engine.stats.completed == 2
    backend.close()


def test_take_following_belongs_to_the_worker_and_completes_what_it_took() -> None:
    stream = CpuStream("s")
    gate = threading.Event()
    seen: list[str] = []

    def first(dep_error: BaseException | None) -> None:
        gate.wait(10)
        for fn in stream.take_following(lambda fn: fn is not stop):
            fn(None)
        seen.append("first")

    def later(dep_error: BaseException | None) -> None:
        seen.append("later")

    def stop(dep_error: BaseException | None) -> None:
        seen.append("stop")

    events = [stream.enqueue_work(f) for f in (first, later, later, stop, later)]
    with pytest.raises(RuntimeEngineError):
        stream.take_following(lambda fn: True)
    gate.set()
    for ev in events:
        ev.synchronize(timeout=10)
    assert seen == ["later", "later", "first", "stop", "later"]
    stream.close()
