"""Cancellation at any await point never leaks a slot and never frees a slot a stream still uses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.runtime import (
    Arena,
    CpuBackend,
    Priority,
    TransferCancelledError,
    TransferEngine,
    TransferError,
    TransferHandle,
    run,
)
from tierkv.runtime.backend import CopyInfo
from tierkv.runtime.errors import SlotBusyError
from tierkv.runtime.loop import has_uvloop

SLOTS = 24
SLOT_BYTES = 256


class CheckingBackend(CpuBackend):
    """Records any copy whose destination slots were freed before or while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def copy_slots(
        self, src: Arena, src_ids: Any, dst: Arena, dst_ids: Any, staging: Any
    ) -> CopyInfo:
        if not dst.is_allocated(dst_ids):
            self.violations.append(f"copy into freed slots {dst_ids.tolist()}")
        time.sleep(0.0005)  # a window for cancellations to land mid-copy
        info = super().copy_slots(src, src_ids, dst, dst_ids, staging)
        if not dst.is_allocated(dst_ids):
            self.violations.append(f"slots {dst_ids.tolist()} freed while being written")
        return info


task_spec = st.tuples(
    st.integers(1, 4),  # pages
    st.sampled_from(list(Priority)),
    st.one_of(st.none(), st.integers(0, 6)),  # cancel after this many loop turns (None: never)
    st.booleans(),  # depends on the previous task's transfer
)


async def scenario(specs: list[tuple[int, Priority, int | None, bool]]) -> None:
    backend = CheckingBackend()
    src = backend.create_arena("src", SLOT_BYTES, SLOTS)
    dst = backend.create_arena("dst", SLOT_BYTES, SLOTS)
    src_ids = src.allocate(SLOTS)
    src.array[:] = np.random.default_rng(0).integers(0, 256, src.array.shape, np.uint8)
    engine = TransferEngine(backend, max_inflight=2)
    deferred: list[TransferHandle] = []
    previous: list[TransferHandle] = []

    async def one(i: int, pages: int, prio: Priority, after: bool) -> None:
        await asyncio.sleep(0)
        ids = dst.allocate(pages)
        h: TransferHandle | None = None
        try:
            await asyncio.sleep(0)
            s = src_ids[(np.arange(pages) * 5 + i) % SLOTS]
            h = engine.submit(src, s, dst, ids, priority=prio, after=previous[-1:] if after else [])
            previous.append(h)
            await h
            assert np.array_equal(dst.array[ids], src.array[s])
        except (TransferCancelledError, TransferError):
            pass
        finally:
            if h is not None and not h.done():
                h.cancel()  # drops it if not started; a started copy runs to the end
            try:
                dst.free(ids)  # the naive path: free at once
            except SlotBusyError:
                assert h is not None and not h.done()
                h.add_done_callback(lambda _h: dst.free(ids))  # free once it really finished
                deferred.append(h)

    tasks = [
        asyncio.create_task(one(i, pages, prio, after))
        for i, (pages, prio, _, after) in enumerate(specs)
        if pages <= SLOTS
    ]
    cancel_at = {i: c for i, (_, _, c, _) in enumerate(specs) if c is not None}
    for turn in range(8):
        for i, c in cancel_at.items():
            if c == turn and i < len(tasks):
                tasks[i].cancel()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.aclose(timeout=10)
    for h in deferred:
        assert h.done()
    assert backend.violations == []
    assert dst.num_free == SLOTS, "leaked slots"
    assert not dst.is_busy(np.arange(SLOTS)) and not src.is_busy(src_ids)
    backend.close()


LOOPS = [False, True] if has_uvloop() else [False]


@pytest.mark.parametrize("use_uvloop", LOOPS, ids=lambda u: "uvloop" if u else "asyncio")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(task_spec, min_size=1, max_size=6))
def test_cancellation_never_leaks_or_frees_busy_slots(
    use_uvloop: bool, specs: list[tuple[int, Priority, int | None, bool]]
) -> None:
    run(scenario(specs), use_uvloop=use_uvloop, debug=not use_uvloop)
