"""The KV store: round trips through every tier path, prefetch, errors, cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import KVSpec, SequenceError, SpecError, StoreClosedError, TierFullError
from tierkv.store import KVStore
from tierkv.tiers import COLD, DEVICE, HOST

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def tokens(seed: int, n: int = 10) -> list[int]:
    return [1000 * seed + i for i in range(n)]


async def fill(store: KVStore, sid: str, seed: int, n: int = 10) -> dict[int, tuple]:
    await store.add_sequence(sid, tokens(seed, n))
    ref = {}
    async with store.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            k, v = kv(n, seed * 10 + layer)
            await lease.append(sid, layer, k, v)
            ref[layer] = (k, v)
    return ref


async def check(store: KVStore, sid: str, ref: dict[int, tuple], atol: float = 0.0) -> None:
    async with store.lease([sid]) as lease:
        for layer, (k, v) in ref.items():
            got_k, got_v = lease.kv(sid, layer)
            if atol == 0.0:
                assert torch.equal(got_k, k) and torch.equal(got_v, v), (sid, layer)
            else:
                assert torch.allclose(got_k, k, atol=atol) and torch.allclose(got_v, v, atol=atol)


async def no_pins_left(store: KVStore) -> None:
    await store.drain()  # background write-behinds and prefetches hold pins while in flight
    table = store.tiers.table
    table.check()
    for k in table.keys(DEVICE):
        assert table.pins(k, DEVICE) == 0, "a device page is still pinned"
    owned = store.tiers.ownership.owners
    for tier in (HOST, COLD):
        if tier in table.tier_names:
            for k in table.keys(tier):
                assert table.pins(k, tier) == (1 if k in owned else 0), (tier, k.hex())
    for k in owned:  # every page a live sequence owns has a copy somewhere
        assert table.tiers_of(k), k.hex()


async def test_round_trip_device_host_device_is_bit_exact() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c", "d"])}
        assert store.stats()["written_back"] > 0
        for s, ref in refs.items():
            await check(store, s, ref)
        assert store.stats()["hits"]["host"] > 0
        await no_pins_left(store)


async def test_round_trip_through_cold_lossless_codec_is_bit_exact() -> None:
    async with KVStore(
        SPEC,
        device_bytes=6 * PAGE,
        host_bytes=40 * PAGE,
        codec="none",
        compress_after=1,
        compress_live=True,
    ) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c"])}
        for _ in range(3):
            store.step()
            await store.drain()
        assert store.counters.idle_compressed > 0
        for s, ref in refs.items():
            await check(store, s, ref)
        assert store.stats()["hits"]["cold"] > 0
        await no_pins_left(store)


async def test_int8_cold_pages_stay_within_the_codec_bound() -> None:
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, compress_after=1, compress_live=True
    ) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c"])}
        for _ in range(3):
            store.step()
            await store.drain()
        assert store.counters.idle_compressed > 0
        for s, ref in refs.items():
            async with store.lease([s]) as lease:
                for layer, (k, _v) in ref.items():
                    got_k, _ = lease.kv(s, layer)
                    # int8 per (head, channel) over a page's tokens: |err| <= scale/2 with
                    # scale = amax/127 of the page, at most the sequence's amax/127
                    bound = k.abs().amax(dim=1, keepdim=True) / 127 / 2 * 1.001 + 1e-6
                    assert ((got_k - k).abs() <= bound).all()
        await no_pins_left(store)


async def test_prefix_is_reused_by_a_later_request() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE) as store:
        ref = await fill(store, "a", 1, n=10)
        await store.release("a")
        assert store.lookup(tokens(1, 10)) == 8  # two full blocks of 4 tokens
        cached = await store.add_sequence("b", tokens(1, 10))
        assert cached == 8
        async with store.lease(["b"]) as lease:
            for layer, (k, v) in ref.items():
                got_k, got_v = lease.kv("b", layer)
                assert torch.equal(got_k, k[:, :8]) and torch.equal(got_v, v[:, :8])
        assert store.stats()["prefix_tokens_reused"] == 8
        await no_pins_left(store)


async def test_prefetch_schedule_loads_ahead() -> None:
    async with KVStore(SPEC, device_bytes=12 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c"])}
        store.schedule([["a"]])
        await store.drain()
        before = store.counters.late_fetches
        await check(store, "a", refs["a"])
        assert store.counters.late_fetches == before
        assert store.stats()["prefetch_used"] > 0
        assert await store.prefetch(["b"], wait=True) >= 0
        await no_pins_left(store)


async def test_all_pinned_device_raises_and_leaks_nothing() -> None:
    # a lease waits for room (first come, first served) at most the store's timeout
    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=40 * PAGE, timeout=0.5) as store:
        await fill(store, "a", 1, n=8)  # 2 blocks x 2 layers = 4 pages
        await fill(store, "b", 2, n=8)
        async with store.lease(["a"]):
            with pytest.raises(TierFullError, match="device tier"):
                async with store.lease(["b"]):
                    pass
        await no_pins_left(store)
        await check(store, "b", {})


async def test_bad_inputs_raise_typed_errors_and_change_nothing() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE) as store:
        ref = await fill(store, "a", 1)
        with pytest.raises(SequenceError):
            await store.add_sequence("a", [1, 2])
        with pytest.raises(SequenceError):
            store.lease(["nope"])
        with pytest.raises(SpecError):
            store.lease(["a"], layers=[5])
        async with store.lease(["a"], layers=[0]) as lease:
            k, v = kv(1, 99)
            with pytest.raises(SpecError, match="dtype"):
                await lease.append("a", 0, k.half(), v.half())
            with pytest.raises(SpecError, match="shape"):
                await lease.append("a", 0, k[:1], v[:1])
            with pytest.raises(SpecError, match="layer"):
                await lease.append("a", 1, k, v)
            with pytest.raises(SequenceError):
                lease.kv("b", 0)
        with pytest.raises(SequenceError):
            lease.kv("a", 0)  # outside the lease
        await check(store, "a", ref)
        await store.release("a")
        with pytest.raises(SequenceError):
            await store.release("a")
        await no_pins_left(store)
    with pytest.raises(StoreClosedError):
        store.lookup([1, 2, 3])
    with pytest.raises(StoreClosedError):
        await store.add_sequence("z", [1])
    with pytest.raises(StoreClosedError):  # (it returned the closed store as if opened)
        await store.open()
    with pytest.raises(StoreClosedError):
        async with store:
            pass


async def test_concurrent_leases_on_a_small_device_keep_every_byte() -> None:
    async with KVStore(SPEC, device_bytes=14 * PAGE, host_bytes=80 * PAGE, codec=None) as store:
        names = [f"s{i}" for i in range(8)]
        refs = {s: await fill(store, s, i) for i, s in enumerate(names)}

        async def reader(s: str) -> None:
            for _ in range(3):
                await check(store, s, refs[s])

        for batch in (names[:2], names[2:4], names[4:6], names[6:]):
            await asyncio.gather(*(reader(s) for s in batch))
        await no_pins_left(store)


@pytest.mark.parametrize("cancel_after", [0, 1, 2, 3, 5, 8, 13])
async def test_cancellation_at_any_await_leaves_no_pin_and_no_leak(cancel_after: int) -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=60 * PAGE, codec=None) as store:
        refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c", "d"])}

        async def work() -> None:  # (loads that copy inline take no loop turn: 5 checks took
            for s in ["a", "b", "c", "d"] * 4:  # 9 turns, 24 before; the 13th must land in it)
                await check(store, s, refs[s])

        task = asyncio.ensure_future(work())
        for _ in range(cancel_after):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.drain()
        for _ in range(20):  # let shielded transfers finish their bookkeeping
            await asyncio.sleep(0.001)
        await no_pins_left(store)
        for s, ref in refs.items():  # and nothing was lost
            await check(store, s, ref)
        await no_pins_left(store)


@settings(max_examples=25, deadline=None)
@given(
    cancel_after=st.integers(0, 40),
    order=st.permutations(["a", "b", "c", "d"]),
    prefetch=st.booleans(),
)
def test_cancellation_property(cancel_after: int, order: list[str], prefetch: bool) -> None:
    """Whatever await a reader is cancelled at: no pin, no leaked slot, no lost byte."""

    async def scenario() -> None:
        async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=60 * PAGE, codec=None) as store:
            refs = {s: await fill(store, s, i) for i, s in enumerate(["a", "b", "c", "d"])}

            async def work() -> None:
                for s in order:
                    if prefetch:
                        store.schedule([[s]])
                    await check(store, s, refs[s])

            task = asyncio.ensure_future(work())
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(20):
                await asyncio.sleep(0.001)
            await no_pins_left(store)
            for s, ref in refs.items():
                await check(store, s, ref)
            await no_pins_left(store)

    asyncio.run(scenario())


async def test_idle_pages_of_a_live_sequence_wait_for_its_release_then_compress() -> None:
    """step() reads only the pages that went idle since the last step (oldest first); a live
    sequence's idle pages are set aside, not re-read each step, and compressed at the first
    step after its release."""
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec="none", compress_after=1
    ) as store:
        refs = {s: await fill(store, s, i, n=8) for i, s in enumerate(["a", "b"])}
        await store.drain()
        for _ in range(3):
            store.step()
            await store.drain()
        assert store.counters.idle_compressed == 0  # owned: never compressed while live
        await check(store, "b", refs["b"])  # b used again: its clock starts over
        await store.release("a")
        store.step()
        await store.drain()
        a_compressed = store.counters.idle_compressed
        assert a_compressed > 0  # a's released pages went at the first step
        for _ in range(2):  # b, live, stays as it is
            store.step()
            await store.drain()
        assert store.counters.idle_compressed == a_compressed
        await check(store, "b", refs["b"])
        await no_pins_left(store)
