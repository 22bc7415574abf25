"""A store with a remote tier: evicted pages are pushed to a page server, another store imports
them bit-exact; a remote that is down, silent or full degrades to a local store (counted).

Servers run in this process (a PageServer over its own store, tcp data transport); the
multi-process paths of the page server are in test_remote.py and test_remote_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from tierkv import KVSpec
from tierkv.remote import PageServer, RemoteTier
from tierkv.remote.sources.cluster import RemoteCluster
from tierkv.store import KVStore
from tierkv.tiers import COLD, DEVICE, HOST

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"remote-store-test"
TIMEOUT = 5.0


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def tokens(seed: int, n: int = 10) -> list[int]:
    return [1000 * seed + i for i in range(n)]


async def fill(store: KVStore, sid: str, seed: int, n: int = 10) -> dict[int, tuple]:
    """A sequence of ``n`` tokens computed and released (its full blocks stay cached)."""
    await store.add_sequence(sid, tokens(seed, n))
    ref = {}
    async with store.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            k, v = kv(n, seed * 10 + layer)
            await lease.append(sid, layer, k, v)
            ref[layer] = (k, v)
    await store.release(sid)
    return ref


async def check_prefix(store: KVStore, sid: str, seed: int, ref: dict[int, tuple]) -> int:
    """Start ``sid`` on prompt ``seed``; the reused prefix must be bit-exact. Returns it."""
    cached = await store.add_sequence(sid, tokens(seed))
    async with store.lease([sid]) as lease:
        for layer, (k, v) in ref.items():
            got_k, got_v = lease.kv(sid, layer)
            assert torch.equal(got_k, k[:, :cached]) and torch.equal(got_v, v[:, :cached])
    await store.release(sid)
    return cached


async def no_pins_left(store: KVStore) -> None:
    await store.drain()
    table = store.tiers.table
    table.check()
    for tier in table.tier_names:
        for k in table.keys(tier):
            assert table.pins(k, tier) == 0, f"a {tier} page is still pinned"


@contextlib.asynccontextmanager
async def page_server(pages: int = 64) -> AsyncIterator[PageServer]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=pages * PAGE, codec=None)
    async with store, PageServer(store, transports=["tcp"], secret=SECRET) as srv:
        yield srv


def peer(srv: PageServer, timeout: float = TIMEOUT) -> RemoteTier:
    return RemoteTier(srv.address, transport="tcp", secret=SECRET, spec=SPEC, timeout=timeout)


def small_store(remote: object, codec: str | None = None, **kw: object) -> KVStore:
    return KVStore(
        SPEC,
        device_bytes=8 * PAGE,
        host_bytes=(12 if codec else 8) * PAGE,
        codec=codec,
        cold_fraction=1 / 3,
        remote=remote,  # type: ignore[arg-type]
        timeout=TIMEOUT,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("codec", [None, "int8"])
async def test_evicted_pages_are_pushed_and_imported_bit_exact(codec: str | None) -> None:
    async with page_server() as srv, peer(srv) as p1, peer(srv) as p2:
        a = small_store(p1, codec)  # 8 device + 8 host pages (+ 4 cold)
        async with a:
            refs = {i: await fill(a, f"a{i}", i) for i in range(6)}  # 36 pages, 8 + 8 local
            await a.drain()
            st = a.stats()["remote"]
            assert st["pushes"] > 0 and st["push_errors"] == 0 and st["errors"] == 0
            assert st["bytes_out"] == st["pushes"] * PAGE
            assert srv.stats()["pages"] == st["pushes"]
            assert st["push_batches"] <= st["push_offered"]
            await no_pins_left(a)
        b = small_store(p2)
        async with b:
            assert b.lookup(tokens(0)) == 0
            assert await b.fetch_prefix(tokens(0)) == 8  # two full blocks, from the server
            imported = 0
            for i, ref in refs.items():
                imported += await check_prefix(b, f"b{i}", i, ref) > 0
            assert imported >= 3  # the oldest prompts surely left a's host tier
            rs = b.stats()["remote"]
            assert rs["hits"] >= 3 * 4 and rs["misses"] == 0 and rs["errors"] == 0
            assert rs["bytes_in"] == rs["hits"] * PAGE
            await no_pins_left(b)


async def test_without_remote_the_store_is_unchanged() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        await fill(s, "a", 1)
        assert "remote" not in s.stats() and s.remote is None
        assert s.tiers.glue.remote_offer is None
        assert await s.fetch_prefix(tokens(1)) == 8


async def test_remote_down_degrades_to_local() -> None:
    async with page_server() as srv:
        p = peer(srv)
        await p.connect()
    # the server is gone: every push and lookup fails fast, none is raised
    a = small_store(p)
    async with a:
        refs = {i: await fill(a, f"a{i}", i) for i in range(6)}
        await a.drain()
        last = max(refs)
        assert await check_prefix(a, "again", last, refs[last]) == 8  # still cached locally
        st = a.stats()["remote"]
        assert st["push_errors"] > 0 and st["pushes"] == 0
        assert st["errors"] > 0 and st["hits"] == 0
        assert "PeerGoneError" in st["last_push_error"]
        await no_pins_left(a)
    await p.aclose()


async def test_silent_remote_is_bounded_and_a_later_source_serves() -> None:
    """A server that accepts and never answers: lookups end within the bound; the next
    source (a live page server) serves the prefix."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        dead = RemoteCluster(addr, secret=SECRET, spec=SPEC, timeout=0.3, retry_after=60)
        async with page_server() as srv, peer(srv) as p1, peer(srv) as p2:
            async with small_store(p1) as a:
                refs = {i: await fill(a, f"a{i}", i) for i in range(6)}
                await a.drain()
            b = small_store([dead, p2], remote_write=False)
            async with b:
                assert b.remote is not None and b.remote.pusher is None
                got = await asyncio.wait_for(check_prefix(b, "b", 0, refs[0]), 10 * TIMEOUT)
                assert got == 8
                rs = b.stats()["remote"]
                assert rs["errors"] >= 1 and "silent" in rs["last_error"]
                assert rs["hits"] == 4 and rs["sources"] == 2
                await no_pins_left(b)
            async with small_store(dead) as c:  # pushes to the silent server fail, bounded
                await asyncio.wait_for(fill(c, "c", 1), 10 * TIMEOUT)
                await asyncio.wait_for(c.drain(), 10 * TIMEOUT)
                rs = c.stats()["remote"]
                assert rs["pushes"] == 0
                await no_pins_left(c)
            await dead.aclose()
    finally:
        silent.close()


async def test_full_remote_counts_errors_and_evictions_go_on() -> None:
    async with page_server(pages=2) as srv, peer(srv) as p, peer(srv) as holder:
        tiers, arena = srv.store.tiers, srv.store.tiers.glue.host_array
        keys = [b"\x01" * 16 + bytes([i]) for i in range(2)]  # two content pages, pinned
        alloc = tiers.glue.reserve_host(keys)
        assert alloc is not None
        arena[alloc.slots] = 7
        tiers.glue.commit_host(keys)
        lease = await holder.acquire(keys)
        assert len(lease.slots) == 2
        a = small_store(p)
        async with a:
            refs = {i: await fill(a, f"a{i}", i) for i in range(6)}
            await a.drain()
            assert await check_prefix(a, "again", 5, refs[5]) == 8
            st = a.stats()["remote"]
            assert st["push_errors"] > 0 and st["pushes"] == 0
            assert "RemoteFullError" in st["last_push_error"]
            await no_pins_left(a)
        assert await holder.release(lease) == 2


async def test_redis_as_the_remote_tier() -> None:
    """Any PageSource is a remote tier: the same push and bit-exact import through Redis."""
    pytest.importorskip("redis")
    sys.path.insert(0, str(Path(__file__).parent))
    from redis_server import RedisServer, skip_without_redis

    from tierkv.remote import RedisTier

    skip_without_redis()
    with RedisServer() as rs:
        for_a = RedisTier(rs.url, spec=SPEC, namespace="remote-store", timeout=TIMEOUT)
        for_b = RedisTier(rs.url, spec=SPEC, namespace="remote-store", timeout=TIMEOUT)
        async with for_a, for_b:
            async with small_store(for_a) as a:
                refs = {i: await fill(a, f"a{i}", i) for i in range(6)}
                await a.drain()
                assert a.stats()["remote"]["pushes"] > 0
            async with small_store(for_b) as b:
                assert await check_prefix(b, "b", 0, refs[0]) == 8
                assert b.stats()["remote"]["hits"] == 4


def test_bad_remote_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="PageSource"):
        KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=8 * PAGE, remote=object())  # type: ignore[arg-type]


async def test_tiers_report_every_host_departure() -> None:
    left: list[bytes] = []
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        s.tiers.glue.add_host_listener(left.extend)
        for i in range(6):
            await fill(s, f"a{i}", i)
        await s.drain()
        table = s.tiers.table
        gone = set(left)
        assert gone and not any(table.present([k], HOST) for k in gone)
        assert COLD not in table.tier_names  # no codec: departed pages are gone
        assert not any(table.present([k], DEVICE) for k in gone)


async def test_a_remote_prefix_longer_than_the_host_imports_what_the_host_holds() -> None:
    """Regression: an import is all or nothing, so a prefix on a page server longer than the
    importing store's host tier imported nothing (found beside the disk tier's same bug)."""
    from tierkv.remote.store_io import publish_prefix

    prompt = tokens(7, 29)  # 7 full blocks (14 pages) and a token to compute
    async with page_server() as srv, peer(srv) as p1, peer(srv) as p2:
        a = KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=32 * PAGE, codec=None)
        async with a:
            await a.add_sequence("a", prompt)
            ref = {}
            async with a.lease(["a"]) as lease:
                for layer in range(SPEC.num_layers):
                    k, v = kv(len(prompt), 70 + layer)
                    await lease.append("a", layer, k, v)
                    ref[layer] = (k, v)
            await a.release("a")
            await a.drain()
            assert await publish_prefix(a, p1, prompt) == 14
        b = KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=8 * PAGE, codec=None, remote=p2)
        async with b:
            assert await b.add_sequence("b", prompt) == 16  # the 8 pages the host holds
            async with b.lease(["b"]) as lease:
                for layer, (k, v) in ref.items():
                    got_k, got_v = lease.kv("b", layer)
                    assert torch.equal(got_k, k[:, :16]) and torch.equal(got_v, v[:, :16])
            await b.release("b")
            assert b.stats()["remote"]["misses"] == 0
            await no_pins_left(b)


async def test_import_prefix_longer_than_the_host_imports_what_the_host_holds() -> None:
    """The same family through import_prefix: a 14-page prefix into an 8-page host raised
    TierFullError ("full of pinned pages") and imported nothing; now its leading 4 blocks."""
    from tierkv.remote.store_io import import_prefix, publish_prefix

    prompt = tokens(8, 29)
    async with page_server() as srv, peer(srv) as p1, peer(srv) as p2:
        a = KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=32 * PAGE, codec=None)
        async with a:
            await fill(a, "a", 8, 29)
            await a.drain()
            assert await publish_prefix(a, p1, prompt) == 14
        b = KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=8 * PAGE, codec=None)
        async with b:
            assert await import_prefix(b, p2, prompt) == 16
            await no_pins_left(b)
