"""Issue 13, findings 1-4 and 6: the store never hangs, leaks or strands a page under
concurrency, cancellation and faults. One regression test (or more) per finding."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from tierkv import SequenceError, SpecError, TierFullError
from tierkv.admission import Admission
from tierkv.errors import StoreClosedError, StoreTimeoutError
from tierkv.keys import KeyKind, key_kind
from tierkv.page_table import PageState
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore
from tierkv.tiers import DEVICE, HOST

from .held_copies import hold_copies
from .test_store import PAGE, SPEC, check, fill, kv, no_pins_left, tokens


async def settle(store: KVStore) -> None:
    """Background copies and their bookkeeping done."""
    await store.drain()
    for _ in range(5):
        await asyncio.sleep(0.001)


def pages_left(store: KVStore) -> int:
    table = store.tiers.table
    return sum(table.used(t) for t in table.tier_names)


def private_left(store: KVStore) -> int:
    """Private pages in any tier (a released sequence leaves none; its full blocks stay)."""
    table = store.tiers.table
    return sum(
        1 for t in table.tier_names for k in table.keys(t) if key_kind(k[:16]) is KeyKind.PRIVATE
    )


def stuck(store: KVStore) -> list[tuple[str, str]]:
    """(tier, key) of every page that is not readable: in flight (or stuck)."""
    table = store.tiers.table
    return [
        (t, k.hex())
        for t in table.tier_names
        for k in table.keys(t)
        if table.state(k, t) != PageState.READABLE
    ]


async def until_moving(store: KVStore) -> None:
    table = store.tiers.table
    for _ in range(1000):
        await asyncio.sleep(0)
        if any(table.state(k, DEVICE) == PageState.MOVING for k in table.keys(DEVICE)):
            return
    raise AssertionError("no eviction started")


# -- finding 1: a rename (rekey at lease end) never races an eviction -----------------------
async def test_rename_never_races_an_eviction() -> None:
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None, write_behind=False
    ) as store:
        await store.add_sequence("s", tokens(1, 8))
        await store.add_sequence("t", tokens(2, 16))
        ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: kv(8, 1), 1: kv(8, 2)}
        async with store.lease(["s"], [0]) as lease:
            await lease.append("s", 0, *ref[0])
        layer1_open = asyncio.Event()
        evicting = asyncio.Event()

        async def s_layer1() -> None:
            async with store.lease(["s"], [1]) as lease:
                await lease.append("s", 1, *ref[1])
                layer1_open.set()
                await evicting.wait()  # S's layer-1 lease ends while its layer 0 moves down

        async def t_evicts() -> None:
            async with store.lease(["t"], [0]) as lease:
                await lease.append("t", 0, *kv(16, 3))  # 4 pages: S's layer 0 must go

        a = asyncio.ensure_future(s_layer1())
        await layer1_open.wait()
        b = asyncio.ensure_future(t_evicts())
        await until_moving(store)
        evicting.set()
        await asyncio.gather(a, b)  # no UnknownPageError for the evicting lease
        await settle(store)
        assert stuck(store) == []
        store.check()
        await asyncio.wait_for(check(store, "s", ref), 5)  # the next lease returns
        store.publish(store.sequence("s"))  # the rename happens once the pages are idle
        assert all(store.sequence("s").shared)
        await check(store, "s", ref)
        await no_pins_left(store)


async def test_waiting_for_a_page_in_flight_is_woken_not_polled() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c"])}
        tiers = store.tiers
        before = tiers.changes.notified
        await asyncio.gather(*(check(store, s, refs[s]) for s in ["a", "b", "c", "a"]))
        assert tiers.changes.notified > before  # waiters were woken by changes
        await no_pins_left(store)


async def test_a_page_that_never_lands_ends_the_wait_with_a_typed_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a copy that hangs is modelled on a stream thread: a small cpu copy would otherwise run
    # inline on the loop's thread (a memcpy, which always ends; issue 26)
    monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")
    async with KVStore(
        SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=0.3
    ) as store:
        ref = await fill(store, "a", 1, n=4)
        await settle(store)
        await fill(store, "b", 2, n=16)  # 8 pages: a's pages leave the device (to the host)
        await settle(store)
        assert not store.tiers.table.present(store.sequence("a").all_pages(), DEVICE)
        gate = hold_copies(monkeypatch, store, HOST)  # a host->device copy waits for the gate
        with pytest.raises(StoreTimeoutError):
            await check(store, "a", ref)
        assert store.admission.active == 0
        assert stuck(store), "the load is still in flight: its device slots are not freed"
        gate.set()
        await check(store, "a", ref)  # the load landed; the next lease uses it
        assert stuck(store) == []
        await no_pins_left(store)


# -- finding 2: release during an in-flight write-behind copy leaks nothing ------------------
async def test_release_during_write_behind_frees_every_private_page() -> None:
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await fill(store, "a", 1, n=6)  # lease ends: write-behind of 4 private pages starts
        await asyncio.sleep(0)  # one loop turn: the copy is in flight, the pages pinned
        table = store.tiers.table
        assert any(table.pins(k, DEVICE) for k in table.keys(DEVICE)), "no copy in flight"
        await store.release("a")
        await settle(store)
        assert private_left(store) == 0  # block 1 (2 tokens) was private on device and host
        assert pages_left(store) == 4  # block 0 stays cached (2 layers, device and host)
        assert not store.tiers.ownership.doomed
        store.check()
        await fill(store, "a", 1, n=6)  # the id is reused: no TierFullError
        await store.release("a")
        await settle(store)
        assert private_left(store) == 0


async def test_soak_of_many_sequences_and_releases_leaves_no_page() -> None:
    async with KVStore(SPEC, device_bytes=12 * PAGE, host_bytes=48 * PAGE, codec=None) as store:
        for round_ in range(6):
            names = [f"r{round_}-{i}" for i in range(6)]
            refs: dict[str, Any] = {}
            for i, s in enumerate(names):
                refs[s] = await fill(store, s, 100 * round_ + i, n=6)
            for s in names[::2]:
                await check(store, s, refs[s])
            for s in names:
                await store.release(s)  # some right after their lease: copies in flight
                await asyncio.sleep(0)
        await settle(store)
        assert private_left(store) == 0
        store.check()


# -- finding 3: release inside the sequence's own lease, then an append ----------------------
async def test_append_after_release_inside_the_lease_pins_nothing() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await store.add_sequence("a", tokens(1, 4))
        async with store.lease(["a"]) as lease:
            await lease.append("a", 0, *kv(4, 1))
            await store.release("a")
            with pytest.raises(SequenceError, match="released"):
                await lease.append("a", 0, *kv(1, 2))  # would open a page
            lease.kv("a", 0)  # what the lease pinned stays readable until it ends
        await settle(store)
        assert pages_left(store) == 0
        await no_pins_left(store)
        store.check()


# -- finding 4: an append whose copy fails rolls back ------------------------------------
async def test_append_of_an_uncopyable_tensor_changes_nothing() -> None:
    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await store.add_sequence("a", tokens(1, 8))
        ref = kv(8, 1)
        async with store.lease(["a"], [0]) as lease:
            meta = torch.empty((SPEC.num_kv_heads, 4, SPEC.head_dim), device="meta")
            with pytest.raises(SpecError):
                await lease.append("a", 0, meta, meta)
            await lease.append("a", 0, *ref)  # later appends still work
        await check(store, "a", {0: ref})
        await no_pins_left(store)
        store.check()


async def test_append_failing_after_allocation_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await store.add_sequence("a", tokens(1, 8))
        tiers = store.tiers

        def broken(slots: Any) -> None:
            raise RuntimeError("copy engine fault")

        ref = kv(8, 1)
        async with store.lease(["a"], [0]) as lease:
            for step in ("zero", "copy"):
                used = tiers.table.used(DEVICE)
                with monkeypatch.context() as m:
                    if step == "zero":
                        m.setattr(tiers.pages, "zero_device", broken)
                    else:  # the write into the page fails after commit, pin and own
                        m.setattr(tiers.pages, "mark_dirty", broken)
                    with pytest.raises(RuntimeError, match="fault"):
                        await lease.append("a", 0, *ref)
                assert tiers.table.used(DEVICE) == used
                assert store.sequence("a").kv_len[0] == 0
                store.check()
            await lease.append("a", 0, *ref)
        await check(store, "a", {0: ref})
        await no_pins_left(store)


# -- finding 6: backpressure --------------------------------------------------------------
async def test_a_lease_that_does_not_fit_waits_for_others_to_end() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i, n=8) for i, s in enumerate(["a", "b"])}  # 4 pages
        order: list[str] = []
        a_in = asyncio.Event()

        async def hold_a() -> None:
            async with store.lease(["a"]):
                order.append("a in")
                a_in.set()
                for _ in range(5):
                    await asyncio.sleep(0)
                order.append("a out")

        async def want_b() -> None:
            await a_in.wait()
            await check(store, "b", refs["b"])  # waits for a's pins to go, then fits
            order.append("b done")

        await asyncio.gather(hold_a(), want_b())
        assert order == ["a in", "a out", "b done"]
        await no_pins_left(store)


async def test_waiting_leases_are_admitted_first_come_first_served() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=60 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i, n=8) for i, s in enumerate("abcd")}
        admitted: list[str] = []
        release_a, a_in = asyncio.Event(), asyncio.Event()

        async def use(s: str, hold: asyncio.Event | None = None) -> None:
            async with store.lease([s]) as lease:
                admitted.append(s)
                a_in.set()
                if hold is not None:
                    await hold.wait()
                assert torch.equal(lease.kv(s, 0)[0], refs[s][0][0])

        first = asyncio.ensure_future(use("a", release_a))
        await a_in.wait()
        later = []
        for s in "bcd":  # each needs 6 of 8 pages: one at a time, in arrival order
            later.append(asyncio.ensure_future(use(s)))
            for _ in range(3):
                await asyncio.sleep(0)
        assert store.admission.waiting == 3
        release_a.set()
        await asyncio.gather(first, *later)
        assert admitted == ["a", "b", "c", "d"]
        store.check()
        await no_pins_left(store)


async def test_a_waiting_lease_can_be_cancelled_and_times_out_typed() -> None:
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=0.3
    ) as store:
        refs = {s: await fill(store, s, i, n=8) for i, s in enumerate("abc")}
        async with store.lease(["a"]):
            waiter = asyncio.ensure_future(check(store, "b", refs["b"]))
            for _ in range(5):
                await asyncio.sleep(0)
            assert store.admission.waiting == 1
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert store.admission.waiting == 0
            with pytest.raises(TierFullError, match="device tier"):
                await check(store, "c", refs["c"])  # bounded by the timeout, typed
            store.check()
        for s, ref in refs.items():  # nothing was lost, nothing stays admitted
            await check(store, s, ref)
        assert store.admission.active == 0
        await no_pins_left(store)


async def test_a_lease_that_could_never_fit_fails_at_once() -> None:
    async with KVStore(
        SPEC, device_bytes=4 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=60
    ) as store:
        await fill(store, "a", 1, n=8)
        await fill(store, "b", 2, n=8)
        async with store.lease(["a"]):
            with pytest.raises(TierFullError, match="never"):
                async with store.lease(["a", "b"]):  # 8 pages on a 4-page device
                    pass
        await no_pins_left(store)


def test_sync_store_from_eight_threads_never_fails() -> None:
    with SyncKVStore(
        SPEC, device_bytes=12 * PAGE, host_bytes=80 * PAGE, codec=None, timeout=20
    ) as store:
        errors: list[BaseException] = []
        refs: dict[str, list[torch.Tensor]] = {}

        def worker(i: int) -> None:
            sid = f"t{i}"
            try:
                store.add_sequence(sid, tokens(i, 8))
                ks = [kv(8, 10 * i + layer) for layer in range(SPEC.num_layers)]
                with store.lease([sid]) as lease:  # 4 pages + 2 to grow: 2 leases at a time
                    for layer, (k, v) in enumerate(ks):
                        lease.append(sid, layer, k, v)
                for step in range(3):
                    store.add_tokens(sid, [step])
                    with store.lease([sid]) as lease:
                        for layer in range(SPEC.num_layers):
                            k, v = kv(1, 1000 * i + 10 * step + layer)
                            lease.append(sid, layer, k, v)
                            old_k, old_v = ks[layer]
                            ks[layer] = (torch.cat([old_k, k], 1), torch.cat([old_v, v], 1))
                with store.lease([sid]) as lease:
                    for layer in range(SPEC.num_layers):
                        got = lease.kv(sid, layer)
                        assert torch.equal(got[0], ks[layer][0])
                        assert torch.equal(got[1], ks[layer][1])
                refs[sid] = []
                store.release(sid)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(refs) == 8
        inner = store.store
        store.call(inner.check)
        table = inner.tiers.table
        assert store.call(lambda: table.used(DEVICE) - table.evictable(DEVICE)) == 0
        assert store.call(lambda: len(table.keys(HOST))) >= 0


async def test_admission_drops_a_cancelled_head_and_loses_no_wakeup() -> None:
    adm = Admission(10)
    deadline = asyncio.get_running_loop().time() + 5.0

    def err() -> TierFullError:
        return TierFullError("no room")

    held = await adm.enter(8, deadline, err)
    a, b, c = (asyncio.ensure_future(adm.enter(n, deadline, err)) for n in (6, 2, 4))
    await asyncio.sleep(0)
    assert adm.waiting == 3
    a.cancel()  # the head is cancelled ...
    adm.leave(held)  # ... and room comes before its task resumes: b and c go in, in order
    assert await b == 2 and await c == 4
    with pytest.raises(asyncio.CancelledError):
        await a
    adm.check()
    assert adm.active == 2 and adm.committed == 6 and adm.waiting == 0
    adm.leave(2)
    adm.leave(4)
    assert adm.active == 0 and adm.committed == 0
    with pytest.raises(TierFullError):  # a deadline that passes: typed, nothing held
        await _full_then_timeout(adm, err)
    assert adm.active == 0 and adm.committed == 0 and adm.waiting == 0


async def _full_then_timeout(adm: Admission, err: Any) -> int:
    loop = asyncio.get_running_loop()
    held = await adm.enter(10, loop.time() + 1.0, err)
    try:
        return await adm.enter(1, loop.time() + 0.05, err)
    finally:
        adm.leave(held)


async def test_closing_the_store_fails_waiting_leases_at_once() -> None:
    store = await KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=60
    ).open()
    refs = {s: await fill(store, s, i, n=8) for i, s in enumerate("ab")}
    holder = store.lease(["a"])
    await holder.__aenter__()
    waiter = asyncio.ensure_future(check(store, "b", refs["b"]))
    for _ in range(5):
        await asyncio.sleep(0)
    assert store.admission.waiting == 1
    await store.close()
    with pytest.raises(StoreClosedError):
        await asyncio.wait_for(waiter, 5)  # not after the 60 s timeout
    await holder.__aexit__(None, None, None)


async def test_admission_at_its_deadline_is_an_admission_not_a_timeout() -> None:
    """Family of the device-room TierFullError (issue 25's follow-up): a waiter admitted in the
    loop turn its deadline passed gave the admission back and raised TierFullError, although
    room had come in time; `Changes.wait` already counts a wake at the deadline as a wake."""
    adm = Admission(4)
    loop = asyncio.get_running_loop()

    def err() -> TierFullError:
        return TierFullError("no room")

    held = await adm.enter(4, loop.time() + 5.0, err)
    deadline = loop.time() + 0.05
    loop.call_at(deadline, adm.leave, held)  # room comes at the very deadline (queued first)
    assert await adm.enter(2, deadline, err) == 2
    assert adm.active == 1 and adm.committed == 2
    adm.leave(2)
    adm.check()
