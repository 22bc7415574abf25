"""A rename happens in one place and reaches every per-page record (issue 25, point 3).

Publishing a full block renames its pages (private key -> content key): the page table, the
owners, the dirty set and the store's idle clock were renamed by hand in two places, and the
prefetcher's record of prefetched pages and eviction's announced pages never: a schedule made
during a lease stopped protecting the block that the lease's end published, and a prefetched
page renamed before its use was never counted as used. Every record now follows
`Ownership.rekey`, the one entry (publish and the renames deferred to idle both call it).
"""

from __future__ import annotations

from tierkv.keys import page_key
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

from .test_store import PAGE, SPEC, check, fill, kv, no_pins_left, tokens


async def test_a_schedule_made_during_a_lease_protects_the_block_its_end_publishes() -> None:
    """A server announces the next step while the current one computes: the pages it
    announced are renamed when that lease ends (a block filled). The next lease's eviction
    must still take other pages first."""
    async with KVStore(
        SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE, codec=None, policy="lru"
    ) as store:
        await store.add_sequence("a", tokens(1, 5))
        async with store.lease(["a"]) as lease:
            for layer in range(SPEC.num_layers):
                k, v = kv(5, 10 + layer)
                await lease.append("a", layer, k, v)  # block 0 full (private), block 1 begun
            store.schedule([["a"]])  # the next step reads a: its pages are announced
        a_pages = store.sequence("a").all_pages()  # block 0 under its content key now
        assert store.sequence("a").shared[0]
        refs = {"c": await fill(store, "c", 3, n=8)}  # used after a: LRU would evict a first
        await store.drain()  # c's write-behind copies ended: its pages can go
        table = store.tiers.table
        assert len(table.present(a_pages, DEVICE)) == len(a_pages)
        refs["b"] = await fill(store, "b", 2, n=5)  # needs 4 device pages: c's go, not a's
        assert len(table.present(a_pages, DEVICE)) == len(a_pages)
        await check(store, "c", refs["c"])
        await no_pins_left(store)
        store.check()


async def test_a_rename_reaches_every_per_page_record() -> None:
    """Pages prefetched, announced, dirty and on the idle clock, renamed through the core's one
    entry: each record holds the new keys and none of the old. (A codec: without one the
    store keeps no idle clock.)"""
    async with KVStore(
        SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE, codec="int8", write_behind=False
    ) as store:
        await fill(store, "a", 1, n=8)  # two full blocks: 4 pages, published
        old = store.sequence("a").all_pages()
        await store.release("a")  # cached: unowned, idle, on the idle clock
        tiers = store.tiers
        store._prefetcher._prefetched.update(old)  # prefetched, not used yet
        tiers.announce(old)
        tiers.pages.mark_dirty(old)
        new = [page_key(bytes([0xEE] * 16), i) for i in range(len(old))]
        assert tiers.ownership.rekey(old, new)
        records = {
            "prefetched": store._prefetcher._prefetched,
            "announced": tiers._evict.soon,
            "announced order": set(tiers._evict.soon_order),
            "dirty": set(tiers.pages.dirty),
            "idle clock": set(store._last_use),
        }
        for name, keys in records.items():
            assert not set(old) & set(keys), f"{name} still holds old keys"
            assert set(new) <= set(keys), f"{name} lacks the new keys"
        used = store.stats()["prefetch_used"]
        store.lease_began(new)  # a lease reads the renamed pages: they were prefetched
        assert store.stats()["prefetch_used"] == used + len(new)
        store.check()
