"""A step's end with no event loop task (issue 26, ``tierkv demo``): ``StepPlan.exit_now``
and ``LocalStore.leave`` end a step whose groups all landed in one pass of the store's loop
(no ``run_until_complete``, no task for the exit), leave nothing pinned or admitted, write the
filled pages behind on the store's own loop, and prefetch the next step's first group only
where its copy would not run inline anyway. A step with a load under way is left alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import torch

from tierkv import SequenceError, TierKVError
from tierkv.errors import StoreClosedError
from tierkv.integrations.hf_store import LocalStore, LoopInUseError
from tierkv.keys import page_key
from tierkv.store import KVStore
from tierkv.tiers import DEVICE, HOST

from .test_step import SPEC, D, H, rand

PAGE = SPEC.page_bytes
T = TypeVar("T")


def _local(device_pages: int = 8) -> LocalStore:
    return LocalStore(SPEC, device_bytes=device_pages * PAGE, host_bytes=200 * PAGE, codec=None)


@contextlib.contextmanager
def _with_a(device_pages: int = 8) -> Iterator[LocalStore]:
    """A LocalStore holding an empty sequence "a"; closed at the end."""
    local = _local(device_pages)
    try:
        local.run(local.store.add_sequence("a", []))
        yield local
    finally:
        local.close()


def _empty() -> dict[int, torch.Tensor]:
    return {layer: torch.empty(H, 0, D) for layer in range(SPEC.num_layers)}


def _step(local: LocalStore, n: int, seed: int, ref: dict[int, torch.Tensor]) -> None:
    """One step of ``n`` tokens over sequence "a" as TieredCache runs it (entered, layers and
    left with no loop run where it can), its K/V checked against ``ref`` (updated)."""
    st = local.store
    plan = st.step_plan(["a"], tokens=n, ahead=1)
    if not local.enter(plan):
        local.run(plan.__aenter__())
    for layer in range(SPEC.num_layers):
        h = plan.layer_now(layer, enter=True)
        started, plan.starting = plan.starting, None
        if h is None:
            h = local.run(plan.layer(layer))
        elif started is not None and not started.done():
            local.turn(started.done)
        k = rand(1, H, n, D, seed=seed + layer)
        h.append(k, k)
        ref[layer] = torch.cat([ref[layer], k[0]], 1)
        got, _ = h.kv()
        assert torch.equal(got[0], ref[layer])
    if not local.leave(plan):
        local.run(plan.__aexit__(None, None, None))
        st.step()


def _idle(local: LocalStore) -> None:
    st = local.store
    local.run(st.drain())
    table = st.tiers.table
    assert all(table.pins(k, DEVICE) == 0 for k in table.keys(DEVICE)), "a page is pinned"
    assert st.admission.committed == 0 and st.admission.active == 0
    st.check()


def test_steps_end_with_no_loop_task_and_write_their_filled_pages_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _with_a(device_pages=12) as local:
        st = local.store
        ref = _empty()
        ran: list[str] = []
        real_run = local.run

        def counted(coro: Coroutine[Any, Any, T]) -> T:
            ran.append(coro.__qualname__)
            return real_run(coro)

        monkeypatch.setattr(local, "run", counted)
        _step(local, 3, 0, ref)
        ran.clear()
        _step(local, 1, 100, ref)  # fills the first page of every layer (4 tokens a page)
        _step(local, 1, 200, ref)
        assert not ran  # entered, loaded, left: no run_until_complete, no task
        # the filled pages' write-behind ran on the store's own loop (not a default loop
        # that nobody runs): every task of the store is its loop's, and the pages landed
        assert all(t.get_loop() is local._loop for t in st._tasks)
        monkeypatch.undo()
        _idle(local)
        seq = st.sequence("a")
        keys = [page_key(seq.block(0), layer) for layer in range(SPEC.num_layers)]
        assert st.tiers.table.present(keys, HOST) == keys
        assert st.stats()["late_fetches"] == 0
        for layer in range(SPEC.num_layers):  # the lease path reads the same bytes
            k, v = local.run(_read(st, layer))
            assert torch.equal(k, ref[layer]) and torch.equal(v, ref[layer])


async def _read(st: KVStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    async with st.lease(["a"], [layer]) as lease:
        k, v = lease.kv("a", layer)
        return k.clone(), v.clone()


@pytest.mark.parametrize("inline", [True, False])
def test_the_next_group_is_prefetched_only_where_its_copy_is_not_inline(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not inline:
        monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")  # every copy on the copy thread
    with _with_a(device_pages=8) as local:
        st = local.store
        ref = _empty()
        for i, n in enumerate((10, 1, 1)):
            _step(local, n, 10 * i, ref)
        _idle(local)
        # the first group's pages were evicted by the later layers' loads at each step: an
        # inline copy loads them at the next entry, a copy thread's at the exit before
        prefetched = st.stats()["prefetched"]
        assert (prefetched == 0) if inline else (prefetched > 0)


def test_exit_now_declines_while_a_group_loads() -> None:
    with _with_a(device_pages=8) as local:
        st = local.store
        plan = st.step_plan(["a"], tokens=1, ahead=1)
        assert local.enter(plan)
        loading = local._loop.create_future()  # a group whose load is under way
        plan._tasks[2] = loading
        assert not plan.exit_now()  # nothing done: still entered, its room held
        assert plan._active and st.admission.committed > 0
        assert not local.leave(plan)
        local.run(plan.__aexit__(None, None, None))  # the load is cancelled, all let go
        assert loading.cancelled()
        _idle(local)
        assert st.sequence("a").kv_len == [0] * SPEC.num_layers


def test_leave_raises_the_exits_error_and_the_loop_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _with_a(device_pages=8) as local:
        st = local.store
        plan = st.step_plan(["a"], tokens=1, ahead=1)
        assert local.enter(plan)

        def broken(g: int) -> None:
            raise SequenceError("release failed")

        monkeypatch.setattr(plan, "_release", broken)
        with pytest.raises(SequenceError, match="release failed"):
            local.leave(plan)
        assert st.admission.committed == 0  # the room went back all the same
        monkeypatch.undo()
        local.run(st.release("a"))  # the loop is not left running
        local.run(st.drain())


def test_leave_is_refused_after_close_and_inside_a_loop() -> None:
    local = _local()
    plan = local.store.step_plan([], tokens=1)

    async def inside() -> None:
        with pytest.raises(LoopInUseError):
            local.leave(plan)

    asyncio.run(inside())
    local.close()
    with pytest.raises(StoreClosedError):
        local.leave(plan)
    assert issubclass(LoopInUseError, TierKVError)


def test_turn_stops_once_done() -> None:
    local = _local()
    try:
        passes: list[int] = []
        loop = local._loop

        def tick() -> None:
            passes.append(1)
            loop.call_soon(tick)

        loop.call_soon(tick)
        local.turn(lambda: len(passes) >= 2, turns=8)
        assert len(passes) == 2  # stopped as soon as done() held, not after 8 passes
        local.turn(turns=3)  # no done(): every pass
        assert len(passes) == 5
    finally:
        local.close()
