"""A step's group loads with no wait and no task (tierkv.step ``_load_now``): on the cpu backend
a group's pages are pinned, loaded by copies that run inline and opened in one synchronous
pass (``LeasePages.acquire_now``, ``DeviceLoads.acquire_now``, ``DeviceEviction.make_room_now``).
Where that cannot be done (a copy that would not run inline, room only by a write-back, a page
in flight, a failing copy) nothing is held and the group loads as before; KV stays exact.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import SpecError
from tierkv.runtime import Priority, TransferError
from tierkv.store import KVStore
from tierkv.tiers import DEVICE, HOST

from .test_step import SPEC, idle, rand

H, D = SPEC.num_kv_heads, SPEC.head_dim
PAGE = SPEC.page_bytes


def _store(device_pages: int = 8, **kw: object) -> KVStore:
    return KVStore(SPEC, device_bytes=device_pages * PAGE, host_bytes=200 * PAGE, codec=None, **kw)


async def _fill(st: KVStore, ids: list[str], n: int = 12) -> dict[tuple[str, int], torch.Tensor]:
    """``n`` tokens of KV (K = V) in every layer of each sequence, through a step; returns
    them. With a small device most of it is on the host afterwards."""
    ref = {}
    for s in ids:
        await st.add_sequence(s, [])
    async with st.step_plan(ids, tokens=n, ahead=0) as step:
        for layer in range(SPEC.num_layers):
            h = await step.layer(layer)
            k = rand(len(ids), H, n, D, seed=layer)
            h.append(k, k)
            for b, s in enumerate(ids):
                ref[(s, layer)] = k[b]
    st.step()
    await st.drain()
    return ref


async def _read_exact(st: KVStore, ref: dict[tuple[str, int], torch.Tensor]) -> None:
    """A step over sequence "a" reads back exactly what :func:`_fill` wrote."""
    async with st.step_plan(["a"], tokens=0, ahead=1) as step:
        for layer in range(SPEC.num_layers):
            k, _ = (await step.layer(layer)).kv()
            assert torch.equal(k[0], ref[("a", layer)])


async def test_groups_load_inline_with_no_task_and_exact_kv() -> None:
    async with _store(device_pages=8) as st:
        ref = await _fill(st, ["a"])
        loads = st.stats()["page_loads"]
        async with st.step_plan(["a"], tokens=0, ahead=1) as step:
            # entry loaded the first two groups here: their futures are done, no loop turn
            assert all(t is not None and t.done() for t in step._tasks[:2])
            for layer in range(SPEC.num_layers):
                h = step.layer_now(layer, enter=True)  # every group landed: no loop run
                assert h is not None
                assert step.starting is None or step.starting.done()
                step.starting = None
                k, v = h.kv()
                assert torch.equal(k[0], ref[("a", layer)]) and torch.equal(v[0], k[0])
        got = st.stats()
        assert got["page_loads"] > loads  # pages did come back from the host
        assert got["late_fetches"] == 0
        await idle(st)


async def test_without_inline_copies_groups_load_in_tasks_with_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")  # every copy on the copy thread
    async with _store(device_pages=8) as st:
        ref = await _fill(st, ["a", "b"], n=5)
        loads = st.stats()["page_loads"]
        async with st.step_plan(["a", "b"], tokens=1, ahead=1) as step:
            assert not all(t is not None and t.done() for t in step._tasks[:2])
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                new = rand(2, H, 1, D, seed=90 + layer)
                h.append(new, new)
                k, _ = h.kv()
                for b, s in enumerate(["a", "b"]):
                    assert torch.equal(k[b], torch.cat([ref[(s, layer)], new[b]], 1))
        assert st.stats()["page_loads"] > loads
        await idle(st)


async def test_room_only_by_a_write_back_is_left_to_the_async_path() -> None:
    # no write-behind: the device holds dirty pages only, so a load's room needs a write-back
    async with _store(device_pages=8, write_behind=False) as st:
        ref = await _fill(st, ["a"])
        table = st.tiers.table
        dirty = [k for k in table.keys(DEVICE) if k in st.tiers._evict.dirty]
        assert dirty and len(table.keys(DEVICE)) == table.capacity(DEVICE)
        host_only = [k for k in table.keys(HOST) if k not in set(table.keys(DEVICE))]
        want = host_only[:2]
        assert len(want) == 2
        before = sorted(table.keys(DEVICE))
        assert st.tiers.pages.acquire_now(want, Priority.DEMAND) is None
        assert sorted(table.keys(DEVICE)) == before  # the victims picked were put back
        for k in before:
            assert table.pins(k, DEVICE) == 0
        await _read_exact(st, ref)  # the step then loads through the write-backs
        await idle(st)


async def test_pages_in_flight_or_in_no_tier_are_left_to_the_async_path() -> None:
    async with _store(device_pages=8) as st:
        await _fill(st, ["a"])
        table = st.tiers.table
        resident = table.keys(DEVICE)[:1]
        assert st.tiers.pages.acquire_now([*resident, b"\x07" * 16], Priority.DEMAND) is None
        assert table.pins(resident[0], DEVICE) == 0  # its pin went with the refusal
        # a page being written (WRITING) is in flight: not loaded here, nothing pinned
        new = [b"\x08" * 16]
        slots = st.tiers.pages.reserve_now(new)
        assert slots is not None
        assert st.tiers.pages.acquire_now(resident + new, Priority.DEMAND) is None
        assert table.pins(resident[0], DEVICE) == 0
        st.tiers.abort_device(new, pinned=False, owned=False)
        await idle(st)


async def test_a_failing_inline_copy_raises_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _store(device_pages=8) as st:
        ref = await _fill(st, ["a"])
        table = st.tiers.table
        host_only = [k for k in table.keys(HOST) if k not in set(table.keys(DEVICE))]
        resident = table.keys(DEVICE)[:1]
        backend = st.tiers.engine.backend

        def broken(*args: object) -> object:
            raise OSError("copy failed")

        monkeypatch.setattr(backend, "copy_slots", broken)
        with pytest.raises(TransferError):  # (the tier core raises it unmapped)
            st.tiers.pages.acquire_now(resident + host_only[:2], Priority.DEMAND)
        assert not table.present(host_only[:2], DEVICE)  # rolled back
        assert table.pins(resident[0], DEVICE) == 0
        monkeypatch.undo()
        await _read_exact(st, ref)  # and nothing was lost
        await idle(st)


async def test_kv_into_a_buffer_is_the_same_gather_and_checks_the_buffer() -> None:
    async with _store(device_pages=40) as st:
        for s in ("a", "b"):
            await st.add_sequence(s, [])
        async with st.step_plan(["a", "b"], tokens=[1, 2], ahead=1) as step:  # lengths 1, 2
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                x = rand(H, 3, D, seed=layer)
                h.append(x, x)
        async with st.step_plan(["a", "b"], tokens=[2, 1], ahead=1) as step:  # both 3: ragged
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                x = rand(H, 3, D, seed=10 + layer)
                h.append(x, x)
                want_k, want_v = h.kv()
                with pytest.raises(SpecError):  # too small: nothing gathered
                    h.kv(out=torch.empty(h.gather_numel() - 1))
                with pytest.raises(SpecError):
                    h.kv(out=torch.empty(h.gather_numel(), dtype=torch.float64))
                buf = torch.full((h.gather_numel() + 5,), float("nan"))
                k, v = h.kv(out=buf)
                assert torch.equal(k, want_k) and torch.equal(v, want_v)
                assert k.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        async with st.step_plan(["a", "b"], tokens=1, ahead=1) as step:  # uniform: by pages
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                x = rand(2, H, 1, D, seed=20 + layer)
                h.append(x, x)
                want_k, want_v = h.kv()
                buf = torch.empty(h.gather_numel() + 7)[7:]  # (a view at an offset)
                k, v = h.kv(out=buf)
                assert torch.equal(k, want_k) and k.shape == (2, H, 4, D)
                assert torch.equal(v, want_v) and torch.equal(v[:, :, -1:], x)
                assert k.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        await idle(st)


async def test_one_sequence_appends_into_its_page_exact_within_and_across_pages() -> None:
    # one sequence whose new tokens fall in one page: one cat into the slot; across a page
    # boundary: the rows' index_copy_. Both bit-identical to what was appended.
    async with _store(device_pages=40) as st:
        await st.add_sequence("a", [])
        ref_k = {layer: torch.empty(H, 0, D) for layer in range(SPEC.num_layers)}
        ref_v = dict(ref_k)
        for n_step, n in enumerate([3, 1, 1, 5, 1, 2, 4, 1]):  # page_tokens 4
            async with st.step_plan(["a"], tokens=n, ahead=1) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    k = rand(1, H, n, D, seed=100 * n_step + layer)
                    v = rand(1, D, H, n, seed=100 * n_step + layer + 50).permute(0, 2, 3, 1)
                    h.append(k, v)  # (v strided, as a model's values are)
                    ref_k[layer] = torch.cat([ref_k[layer], k[0]], 1)
                    ref_v[layer] = torch.cat([ref_v[layer], v[0]], 1)
                    got_k, got_v = h.kv()
                    assert torch.equal(got_k[0], ref_k[layer])
                    assert torch.equal(got_v[0], ref_v[layer])
            st.step()
        for layer in range(SPEC.num_layers):  # the lease path reads the same bytes
            async with st.lease(["a"], [layer]) as lease:
                k, v = lease.kv("a", layer)
                assert torch.equal(k, ref_k[layer]) and torch.equal(v, ref_v[layer])
        await idle(st)


async def test_enter_now_takes_the_room_at_once_or_holds_nothing() -> None:
    async with _store(device_pages=8) as st:
        ref = await _fill(st, ["a"])
        loop = asyncio.get_running_loop()
        admission = st.admission
        held = admission.enter_now(admission.capacity)  # another step holds every page
        assert held is not None
        plan = st.step_plan(["a"], tokens=1, ahead=1)
        blocks = st.sequence("a").num_blocks
        assert not plan.enter_now(loop)  # it would wait: nothing held, nothing changed
        assert admission.committed == held and admission.active == 1
        assert st.sequence("a").num_blocks == blocks
        admission.leave(held)
        assert plan.enter_now(loop)  # room at once: entered, its first groups loaded here
        try:
            for layer in range(SPEC.num_layers):
                # (a group whose room needs a write-back of this step's pages loads in a task)
                h = plan.layer_now(layer, enter=True) or await plan.layer(layer)
                plan.starting = None
                new = rand(1, H, 1, D, seed=70 + layer)
                h.append(new, new)
                k, _ = h.kv()
                assert torch.equal(k[0], torch.cat([ref[("a", layer)], new[0]], 1))
        finally:
            await plan.__aexit__(None, None, None)
        assert st.sequence("a").kv_len == [13] * SPEC.num_layers
        await idle(st)


def _tenants_store(device_pages: int = 8) -> KVStore:
    from tierkv import Quota

    return _store(device_pages, tenants={"x": Quota(), "y": Quota()})


async def test_a_step_of_several_tenants_loads_with_no_task_room_tenant_by_tenant() -> None:
    """Regression: a step plan over several tenants' sequences always loaded its groups in
    tasks (a loop turn each, and the slow path's calls): ``_start`` skipped ``_load_now`` for
    them. Now each tenant's new pages get their room on their own, at once."""
    async with _tenants_store(device_pages=8) as st:
        for s, who in (("a", "x"), ("b", "y")):
            await st.add_sequence(s, [], tenant=who)
        ref = {}
        for rnd in range(2):  # the first fills (pages reach the host), the second loads back
            async with st.step_plan(["a", "b"], tokens=3, ahead=1) as step:
                assert all(t is not None and t.done() for t in step._tasks[:2])
                for layer in range(SPEC.num_layers):
                    h = step.layer_now(layer, enter=True) or await step.layer(layer)
                    step.starting = None
                    new = rand(2, H, 3, D, seed=10 * rnd + layer)
                    h.append(new, new)
                    k, _ = h.kv()
                    for b, s in enumerate(["a", "b"]):
                        ref[(s, layer)] = torch.cat([ref.get((s, layer), new[b][:, :0]), new[b]], 1)
                        assert torch.equal(k[b], ref[(s, layer)])
            st.step()
            await st.drain()
        assert st.tenants is not None
        assert st.tenants.check(lambda t: st.tiers.table.keys(t)) is None
        pages = st.stats()["tenants"]
        assert pages["x"]["tiers"]["device"]["pages"] > 0
        assert pages["y"]["tiers"]["device"]["pages"] > 0
        await idle(st)


async def test_room_at_once_tenant_by_tenant_is_all_or_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierkv.tenant_room import reserve_now_by_tenant

    async with _tenants_store(device_pages=8) as st:
        assert st.tenants is not None
        pages = st.tiers.pages
        keys = [bytes([i]) * 16 for i in (1, 2, 3)]
        st.tenants.charge(keys[:2], 0, new=True)
        st.tenants.charge(keys[2:], 1, new=True)
        real = pages.reserve_now
        calls: list[int] = []

        def second_finds_no_room(part: list[bytes]) -> list[int] | None:
            calls.append(len(part))
            return real(part) if len(calls) == 1 else None

        monkeypatch.setattr(pages, "reserve_now", second_finds_no_room)
        assert reserve_now_by_tenant(st.tiers, st.tenants, keys) is None
        assert len(calls) == 2  # one part each
        assert not st.tiers.table.present(keys, DEVICE)  # the first part's room was undone
        monkeypatch.setattr(pages, "reserve_now", real)
        slots = reserve_now_by_tenant(st.tiers, st.tenants, keys)
        assert slots is not None and len(set(slots)) == 3
        st.tiers.abort_device(keys, pinned=False, owned=False)
        await idle(st)
