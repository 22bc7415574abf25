"""RedisTier against a private redis-server: bit-exact round trips (store to store through
Redis too), checked values, isolated namespaces, TTL, a full server, and a server killed,
frozen or absent (misses, never an exception, then recovery).

Every async test runs under asyncio (debug) and uvloop; each starts from an empty server.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

redis = pytest.importorskip("redis")
pytest.importorskip("xxhash")  # with redis: the `redis` extra

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, free_port, skip_without_redis  # noqa: E402

from tierkv import KVStore  # noqa: E402
from tierkv.errors import SpecError  # noqa: E402
from tierkv.page_sums import PageCheck, row_sums  # noqa: E402
from tierkv.remote import RedisTier, import_prefix, prefix_pages, publish_prefix  # noqa: E402
from tierkv.remote.sources.redis_tier import HEADER_BYTES  # noqa: E402
from tierkv.spec import KVSpec  # noqa: E402

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PB = SPEC.page_bytes
LOG = "tierkv.remote.redis"
BOUND = 20.0  # outer bound of anything that waits for the server (never reached when healthy)


def keys_of(seed: int, n: int) -> list[bytes]:
    """``n`` distinct 18-byte page keys."""
    rng = np.random.default_rng(seed)
    return [rng.bytes(18) for _ in range(n)]


def pages_of(seed: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed + 10_000).integers(0, 256, (n, PB), np.uint8)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    skip_without_redis()
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def srv(server: RedisServer) -> Iterator[RedisServer]:
    """The module's server, emptied."""
    if not server.ping():
        server.restart()
    with redis.Redis.from_url(server.url) as r:
        r.flushall()
        r.config_set("maxmemory", 0)
    yield server


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of its own, for tests that kill, freeze or fill it."""
    skip_without_redis()
    with RedisServer() as s:
        yield s


def tier(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("spec", SPEC)
    kw.setdefault("namespace", "test-model")
    kw.setdefault("timeout", 2.0)
    t = RedisTier(url, **kw)
    t.backoff_base, t.backoff_cap = 0.02, 0.2
    return t


async def until(cond: Any, what: str) -> None:
    """Poll the async predicate ``cond`` until true (bounded by BOUND)."""
    try:
        async with asyncio.timeout(BOUND):
            while True:
                if await cond():
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {BOUND} s: {what}") from None


# -- round trips -----------------------------------------------------------------------------
async def test_round_trip_is_bit_exact(srv: RedisServer) -> None:
    n = 100
    keys, src = keys_of(1, n), pages_of(1, n)
    async with tier(srv.url, batch_pages=7) as rt:  # several chunks, one partial
        assert rt.available
        assert await rt.lookup(keys) == 0
        assert await rt.publish(keys, src, list(range(n))) == n
        assert await rt.publish(keys[:10], src, list(range(10))) == 0  # already there
        assert await rt.lookup(keys) == n
        assert await rt.lookup([*keys[:5], keys_of(2, 1)[0], *keys[5:]]) == 5
        dst = np.full((2 * n, PB), 0xA5, np.uint8)
        slots = list(range(2 * n - 1, n - 1, -1))
        assert await rt.load(keys, dst, slots) == n
        assert (dst[slots] == src).all()
        assert (dst[:n] == 0xA5).all()  # other rows untouched
        # a gap: the pages after the first absent one are not loaded
        gap = [*keys[:3], keys_of(3, 1)[0], *keys[3:6]]
        dst[:] = 0
        assert await rt.load(gap, dst, list(range(7))) == 3
        assert (dst[:3] == src[:3]).all() and (dst[3:7] == 0).all()
        s = rt.stats()
        assert (s["hits"], s["misses"], s["stored"], s["present"]) == (n + 3, 4, n, 10)
        assert s["bytes_out"] == s["bytes_in"] * n // (n + 3) == n * (HEADER_BYTES + PB)
        assert (s["corrupt"], s["errors"], s["timeouts"], s["available"]) == (0, 0, 0, 1)
        assert await rt.load([], dst, []) == 0 and await rt.publish([], dst, []) == 0


async def test_ttl_is_set_renewed_by_reads_and_respected(srv: RedisServer) -> None:
    keys, src = keys_of(4, 8), pages_of(4, 8)
    async with tier(srv.url, ttl=30.0) as rt, tier(srv.url, ttl=0.3) as short:
        assert await rt.publish(keys[:4], src, [0, 1, 2, 3]) == 4
        with redis.Redis.from_url(srv.url) as r:
            assert all(0 < r.pttl(rt.redis_key(k)) <= 30_000 for k in keys[:4])
            r.pexpire(rt.redis_key(keys[0]), 5_000)
            assert await rt.load(keys[:1], np.zeros((1, PB), np.uint8), [0]) == 1
            assert r.pttl(rt.redis_key(keys[0])) > 5_000  # GETEX renewed it
        assert await short.publish(keys[4:], src, [4, 5, 6, 7]) == 4

        async def expired() -> bool:
            return await short.lookup(keys[4:]) == 0

        await until(expired, "pages with a 0.3 s ttl expire")
        assert await rt.lookup(keys[:4]) == 4


async def test_import_prefix_moves_a_prompt_between_stores(srv: RedisServer) -> None:
    tokens = np.random.default_rng(7).integers(0, 1000, 16 * 6 + 5).tolist()

    def store() -> KVStore:
        return KVStore(SPEC, device_bytes=4 * PB, host_bytes=32 * PB, codec=None, namespace="m")

    async with store() as a, store() as b, tier(srv.url) as rt:
        pages = prefix_pages(a, tokens)
        assert len(pages) == 6 * SPEC.num_layers
        arena = a.tiers.glue.host_array
        alloc = a.tiers.glue.reserve_host(pages)
        assert alloc is not None
        want = pages_of(7, len(pages))
        arena[list(alloc.slots)] = want
        a.tiers.glue.commit_host(pages)
        assert await publish_prefix(a, rt, tokens) == len(pages)
        assert b.lookup(tokens) == 0
        assert await import_prefix(b, rt, tokens) == 6 * 16
        assert b.lookup(tokens) == 6 * 16
        got = b.tiers.glue.host_array
        for i, k in enumerate(pages):
            assert (got[b.tiers.table.slot(k, "host")] == want[i]).all()


# -- isolation and checking ------------------------------------------------------------------
async def test_namespaces_and_layouts_are_isolated(srv: RedisServer) -> None:
    keys, a_pages, b_pages = keys_of(5, 6), pages_of(5, 6), pages_of(6, 6)
    other = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16, dtype="bf16")
    assert other.page_bytes == PB  # same size, another layout
    async with (
        tier(srv.url, namespace="model-a") as a,
        tier(srv.url, namespace="model-b") as b,
        tier(srv.url, namespace="model-a", spec=other) as a2,
    ):
        assert await a.publish(keys, a_pages, list(range(6))) == 6
        assert await b.lookup(keys) == 0 and await a2.lookup(keys) == 0
        out = np.zeros((6, PB), np.uint8)
        assert await b.load(keys, out, list(range(6))) == 0
        assert await b.publish(keys, b_pages, list(range(6))) == 6  # same keys, own copies
        assert await a.load(keys, out, list(range(6))) == 6 and (out == a_pages).all()
        assert await b.load(keys, out, list(range(6))) == 6 and (out == b_pages).all()
        assert a.stats()["corrupt"] == b.stats()["corrupt"] == 0
        assert len({a.redis_key(keys[0]), b.redis_key(keys[0]), a2.redis_key(keys[0])}) == 3


def _truncate(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    return value[: len(value) // 2]


def _flip_payload(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    b = bytearray(value)
    b[HEADER_BYTES + 100] ^= 0x01
    return bytes(b)


def _flip_checksum(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    b = bytearray(value)
    b[HEADER_BYTES - 1] ^= 0x80
    return bytes(b)


def _other_layout(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    b = bytearray(value)
    b[8] ^= 0xFF  # the spec digest
    return bytes(b)


def _garbage(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    return b"not a page"


def _padded(value: bytes, rt: RedisTier, key: bytes) -> bytes:
    return value + b"\0"


CORRUPTIONS = [_truncate, _flip_payload, _flip_checksum, _other_layout, _garbage, _padded]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
async def test_corrupted_value_is_a_miss_and_a_warning(
    srv: RedisServer, corrupt: Any, caplog: pytest.LogCaptureFixture
) -> None:
    keys, src = keys_of(8, 6), pages_of(8, 6)
    async with tier(srv.url) as rt:
        assert await rt.publish(keys, src, list(range(6))) == 6
        with redis.Redis.from_url(srv.url) as r:
            rk = rt.redis_key(keys[3])
            r.set(rk, corrupt(r.get(rk), rt, keys[3]))
            out = np.zeros((6, PB), np.uint8)
            with caplog.at_level(logging.WARNING, LOG):
                assert await rt.load(keys, out, list(range(6))) == 3
            assert (out[:3] == src[:3]).all() and (out[3:] == 0).all()  # nothing bad copied
            assert rt.stats()["corrupt"] == 1
            assert any("rejected" in m for m in caplog.messages)
            assert r.exists(rk) == 0  # dropped, so that a publish repairs it
        assert await rt.publish(keys, src, list(range(6))) == 1
        assert await rt.load(keys, out, list(range(6))) == 6 and (out == src).all()


async def test_a_page_already_wrong_at_the_publisher_fails_its_crc(srv: RedisServer) -> None:
    """End to end: the value is well formed (its XXH3 is of the bytes stored), but the page's
    CRC-32C, from the publisher's page table, is of the page as it was when it became final."""
    keys, src = keys_of(12, 6), pages_of(12, 6)
    sums = row_sums(src, list(range(6)))
    flipped = src.copy()
    flipped[3, 77] ^= 0x08  # host memory went wrong between the seal and the publish
    async with tier(srv.url) as rt:
        assert await rt.publish(keys, flipped, list(range(6)), sums=sums) == 6
        out = np.zeros((6, PB), np.uint8)
        check = PageCheck()
        assert await rt.load(keys, out, list(range(6)), check) == 3
        assert (out[:3] == src[:3]).all() and check.sums == sums[:3] and check.corrupt == 1
        assert rt.stats()["corrupt"] == 1
        with redis.Redis.from_url(srv.url) as r:
            assert r.exists(rt.redis_key(keys[3])) == 0  # dropped: a publish repairs it
        assert await rt.publish(keys, src, list(range(6)), sums=sums) == 1
        assert await rt.load(keys, out, list(range(6))) == 6 and (out == src).all()


async def test_value_moved_to_another_key_is_rejected(srv: RedisServer) -> None:
    keys, src = keys_of(9, 2), pages_of(9, 2)
    async with tier(srv.url) as rt:
        assert await rt.publish(keys[:1], src, [0]) == 1
        with redis.Redis.from_url(srv.url) as r:
            r.set(rt.redis_key(keys[1]), r.get(rt.redis_key(keys[0])))  # well-formed, wrong key
        assert await rt.load(keys[1:], np.zeros((1, PB), np.uint8), [0]) == 0
        assert rt.stats()["corrupt"] == 1


async def test_caller_bugs_raise_spec_errors(srv: RedisServer) -> None:
    keys, src = keys_of(10, 4), pages_of(10, 4)
    async with tier(srv.url) as rt:
        bad_calls = [
            rt.load(keys, src.astype(np.int8), [0, 1, 2, 3]),  # dtype
            rt.load(keys, src[:, :-1], [0, 1, 2, 3]),  # page size
            rt.load(keys, src.reshape(-1), [0, 1, 2, 3]),  # 1-D
            rt.load(keys, src, [0, 1, 2]),  # fewer slots
            rt.load(keys, src, [0, 1, 2, 4]),  # out of range
            rt.load(keys, src, [0, 1, 1, 2]),  # one slot twice
            rt.publish(keys, src, [0, 1, 2]),  # len mismatch
            rt.publish(keys, src, [0, 1, 2, -1]),  # negative
            rt.publish([*keys[:3], "k"], src, [0, 1, 2, 3]),  # type: ignore[list-item]
            rt.lookup([b""]),
        ]
        for call in bad_calls:
            with pytest.raises(SpecError):
                await call
        ro = src.copy()
        ro.flags.writeable = False
        with pytest.raises(SpecError):
            await rt.load(keys, ro, [0, 1, 2, 3])
        assert await rt.publish(keys, ro, [0, 1, 2, 3]) == 4  # reading a read-only array is fine
    for kw in ({"namespace": "a b"}, {"namespace": "{tag}"}, {"ttl": 0}, {"timeout": -1},
               {"batch_pages": 0}, {"ttl": "5"}, {"ttl": float("inf")}, {"ttl": 10**400},
               {"timeout": float("nan")}, {"timeout": float("inf")}, {"ttl": True}):  # fmt: skip
        with pytest.raises(SpecError):
            RedisTier(srv.url, spec=SPEC, **kw)
    with pytest.raises(ValueError):
        RedisTier("http://nowhere", spec=SPEC)


# -- degradation -----------------------------------------------------------------------------
async def test_server_killed_and_restarted_mid_run(own_server: RedisServer) -> None:
    keys, src = keys_of(11, 40), pages_of(11, 40)
    out = np.zeros((40, PB), np.uint8)
    async with tier(own_server.url) as rt:
        assert await rt.publish(keys[:20], src, list(range(20))) == 20
        own_server.kill()
        # every call: misses, no exception, bounded
        async with asyncio.timeout(BOUND):
            assert await rt.load(keys[:20], out, list(range(20))) == 0
            assert not rt.available and rt.stats()["available"] == 0
            assert await rt.lookup(keys) == 0
            assert await rt.publish(keys[20:], src, list(range(20, 40))) == 0
        s = rt.stats()
        assert s["errors"] + s["timeouts"] >= 1 and s["misses"] == 20
        own_server.restart()  # empty: nothing was saved

        async def back() -> bool:
            return await rt.publish(keys, src, list(range(40))) == 40

        await until(back, "the tier reconnects after the restart")
        assert rt.available and rt.stats()["reconnects"] >= 1
        assert await rt.load(keys, out, list(range(40))) == 40 and (out == src).all()


async def test_frozen_server_costs_a_bounded_wait(own_server: RedisServer) -> None:
    keys, src = keys_of(12, 8), pages_of(12, 8)
    out = np.zeros((8, PB), np.uint8)
    async with tier(own_server.url, timeout=0.3) as rt:
        assert await rt.publish(keys, src, list(range(8))) == 8
        own_server.pause()
        try:
            async with asyncio.timeout(BOUND):
                assert await rt.load(keys, out, list(range(8))) == 0
                assert await rt.lookup(keys) == 0  # backing off, or a second bounded wait
        finally:
            own_server.resume()
        assert rt.stats()["timeouts"] >= 1 and not rt.available

        async def back() -> bool:
            return await rt.load(keys, out, list(range(8))) == 8

        await until(back, "the tier recovers once the server answers")
        assert (out == src).all() and rt.available


async def test_cancelled_load_leaves_the_tier_usable(own_server: RedisServer) -> None:
    keys, src = keys_of(15, 8), pages_of(15, 8)
    out = np.zeros((8, PB), np.uint8)
    async with tier(own_server.url, timeout=10.0) as rt:
        assert await rt.publish(keys, src, list(range(8))) == 8
        own_server.pause()
        try:
            task = asyncio.create_task(rt.load(keys, out, list(range(8))))
            await asyncio.sleep(0.2)  # the request is out, no reply can come
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            own_server.resume()
        assert (out == 0).all()  # nothing landed
        assert rt.available  # a cancellation is not an outage

        async def back() -> bool:
            return await rt.load(keys, out, list(range(8))) == 8

        await until(back, "loads work after a cancelled one")
        assert (out == src).all() and rt.stats()["timeouts"] == 0


async def test_absent_server_is_misses_from_the_start() -> None:
    async with tier(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5) as rt:
        assert not rt.available
        assert await rt.lookup(keys_of(13, 2)) == 0
        assert await rt.load(keys_of(13, 2), pages_of(13, 2), [0, 1]) == 0
        assert await rt.publish(keys_of(13, 2), pages_of(13, 2), [0, 1]) == 0
        assert rt.stats()["errors"] >= 1


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
async def test_full_server_degrades_publish(own_server: RedisServer, policy: str) -> None:
    with redis.Redis.from_url(own_server.url) as r:
        r.config_set("maxmemory", 2 * 1024 * 1024)
        r.config_set("maxmemory-policy", policy)
    n = 64  # pages of ~4 KiB per batch, 16 batches: ~4 MiB offered to a 2 MiB server
    stored = 0
    async with tier(own_server.url) as rt:
        for i in range(16):
            stored += await rt.publish(keys_of(100 + i, n), pages_of(i, n), list(range(n)))
        s = rt.stats()
        assert rt.available and s["errors"] == 0
        if policy == "noeviction":  # refused, counted, not raised
            assert 0 < stored < 16 * n and s["full"] == 16 * n - stored
        else:  # LRU made room: every publish landed, older pages made way
            assert stored == 16 * n and s["full"] == 0
            with redis.Redis.from_url(own_server.url) as r:
                assert r.info("stats")["evicted_keys"] > 0
                assert 0 < r.dbsize() < 16 * n
                # a server over maxmemory evicts before any command, reads too: lift the limit
                # so that what LRU left stays put between the lookup and the load
                r.config_set("maxmemory", 0)
            kept = []  # (batch, page) of every page LRU left (it may take new ones too)
            for i in range(16):
                for j, key in enumerate(keys_of(100 + i, n)):
                    if await rt.lookup([key]):
                        kept.append((i, j))
            assert kept
            out = np.zeros((len(kept), PB), np.uint8)
            keys = [keys_of(100 + i, n)[j] for i, j in kept]
            assert await rt.load(keys, out, list(range(len(kept)))) == len(kept)
            for row, (i, j) in enumerate(kept):  # what LRU left is still exact
                assert (out[row] == pages_of(i, n)[j]).all()


@pytest.mark.parametrize("ttl", [None, 60.0])
async def test_foreign_value_type_is_a_miss_not_an_outage(srv: RedisServer, ttl: Any) -> None:
    keys, src = keys_of(14, 4), pages_of(14, 4)
    async with tier(srv.url, ttl=ttl) as rt:
        assert await rt.publish(keys[:2], src, [0, 1]) == 2
        with redis.Redis.from_url(srv.url) as r:
            r.rpush(rt.redis_key(keys[2]), b"x")  # GETEX on a list: an error reply
            assert await rt.lookup(keys) == 2  # corrupt (issue 23), dropped: not an error
            assert rt.stats()["corrupt"] == 1 and r.exists(rt.redis_key(keys[2])) == 0
            r.rpush(rt.redis_key(keys[2]), b"x")  # and again, for the load to meet
        assert await rt.load(keys, np.zeros((4, PB), np.uint8), [0, 1, 2, 3]) == 2
        assert rt.available and rt.stats()["errors"] == 0
        assert rt.stats()["corrupt"] == 2
        assert await rt.publish(keys, src, [0, 1, 2, 3]) == 2  # the list was dropped: 2 and 3
        assert rt.available and rt.stats()["present"] == 2


# -- the value codec (no server) -------------------------------------------------------------
TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=1)  # 128-byte pages


@settings(max_examples=100, deadline=None)
@given(
    payload=st.binary(min_size=TINY.page_bytes, max_size=TINY.page_bytes),
    key=st.binary(min_size=1, max_size=40),
    pos=st.integers(0, HEADER_BYTES + TINY.page_bytes - 1),
    bit=st.integers(0, 7),
)
def test_value_round_trips_and_any_bit_flip_is_caught(
    payload: bytes, key: bytes, pos: int, bit: int
) -> None:
    rt = RedisTier(spec=TINY, namespace="codec")  # never connected
    rk = rt.redis_key(key)
    value = rt._value(rk, np.frombuffer(payload, np.uint8))
    assert len(value) == HEADER_BYTES + TINY.page_bytes
    got = rt._verify(rk, value)
    assert got is not None and got.tobytes() == payload
    flipped = bytearray(value)
    flipped[pos] ^= 1 << bit
    assert rt._verify(rk, bytes(flipped)) is None
    assert rt._verify(rt.redis_key(key + b"\0"), value) is None  # bound to its key
    assert rt.stats()["corrupt"] == 2


@pytest.mark.parametrize(
    ("policy", "ttl", "warned"),
    [("noeviction", None, True), ("volatile-lru", None, True), ("volatile-lru", 60.0, False),
     ("allkeys-lru", None, False)],
)  # fmt: skip
async def test_connect_warns_about_an_eviction_policy_that_does_not_fit(
    srv: RedisServer, policy: str, ttl: Any, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with redis.Redis.from_url(srv.url) as r:
        r.config_set("maxmemory-policy", policy)
    try:
        with caplog.at_level(logging.WARNING, LOG):
            async with tier(srv.url, ttl=ttl) as rt:
                assert rt.server_policy == policy
        assert any("maxmemory-policy" in m for m in caplog.messages) == warned
    finally:
        with redis.Redis.from_url(srv.url) as r:
            r.config_set("maxmemory-policy", "noeviction")


@pytest.mark.parametrize("ttl", [None, 60.0], ids=["mget", "getex"])
async def test_a_key_of_another_type_is_corrupt_and_repaired(srv: RedisServer, ttl: Any) -> None:
    """A list at a page's key (issue 23): a load counts it as corrupt and drops it; a publish
    that meets one replaces it (before, the page stayed a miss and republishing stored 0);
    pages already present cost the publish one STRLEN each, nothing else changes."""
    keys, src = keys_of(21, 6), pages_of(21, 6)
    out = np.zeros((6, PB), np.uint8)
    async with tier(srv.url, ttl=ttl) as rt:
        assert await rt.publish(keys, src, list(range(6))) == 6
        with redis.Redis.from_url(srv.url) as r:
            rk = rt.redis_key(keys[3])
            r.delete(rk)
            r.rpush(rk, b"not a page")
            assert await rt.load(keys, out, list(range(6))) == 3
            assert rt.stats()["corrupt"] == 1 and rt.stats()["errors"] == 0
            assert r.exists(rk) == 0  # dropped, so that a publish repairs it
            r.rpush(rk, b"not a page")  # again, and this time a publish meets it first
            assert await rt.publish(keys, src, list(range(6))) == 1
            assert rt.stats()["corrupt"] == 2 and rt.stats()["present"] == 5
            assert r.type(rk) == b"string"
        assert await rt.load(keys, out, list(range(6))) == 6 and (out == src).all()
