"""RedisTier against a real 3-node Redis Cluster on loopback, and slots migrating under reads.

One cluster serves the whole module (starting it costs seconds); each test empties it first.
A slot is moved online the way ``redis-cli --cluster reshard`` does it (redis_cluster.py), so
a client that asked the old owner is answered ASK while the slot is half moved and MOVED once
it is gone; the nodes' own error counters (INFO errorstats) prove both happened.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("redis")  # redis-py: the redis extra
pytest.importorskip("xxhash")  # RedisTier's checksum: the redis extra

from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from tierkv import prefix_keys
from tierkv.keys import page_key
from tierkv.remote.sources.redis_tier import RedisTier
from tierkv.spec import KVSpec

sys.path.insert(0, str(Path(__file__).parent))  # the sibling harness modules
from redis_cluster import RedisCluster, available

_WHY_NOT = available()  # no server binary, or one older than 7.0
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PAGES = 96  # enough keys to land on every node, and on many slots
TIMEOUT = 5.0  # RedisTier's bound per call: generous, the machine is shared
Array = np.ndarray[Any, np.dtype[np.uint8]]


def page_keys(seed: int, n: int = PAGES) -> list[bytes]:
    """``n`` content page keys (block-major) of a prompt drawn from ``seed``."""
    toks = np.random.default_rng(seed).integers(0, 1000, n // 2 * 16).tolist()
    return [page_key(b, layer) for b in prefix_keys(toks, 16) for layer in range(2)]


def page_bytes(seed: int, n: int = PAGES) -> Array:
    """The bytes of ``n`` pages: [n, page_bytes], drawn from ``seed``."""
    return np.random.default_rng(seed + 1).integers(0, 256, (n, SPEC.page_bytes), np.uint8)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(3) as c:
        yield c


@pytest.fixture
def empty(cluster: RedisCluster) -> RedisCluster:
    """The module's cluster with no keys, no migration under way and zeroed counters."""
    cluster.reset()
    return cluster


def _tier(cluster: RedisCluster, namespace: str = "cluster-test") -> RedisTier:
    return RedisTier(cluster.url, spec=SPEC, namespace=namespace, cluster=True, timeout=TIMEOUT)


async def _publish(tier: RedisTier, keys: list[bytes], data: Array) -> None:
    src = np.ascontiguousarray(data[::-1])  # rows reversed: slots are not the page order
    assert await tier.publish(keys, src, list(range(len(keys) - 1, -1, -1))) == len(keys)


def _slot_of_each_node(cluster: RedisCluster, per_node: int) -> list[tuple[int, int]]:
    """(slot, owner index) of up to ``per_node`` key-holding slots per node."""
    picked: list[tuple[int, int]] = []
    count = [0] * cluster.n
    for slot in sorted(cluster.keys_by_slot()):
        owner = cluster.owner(slot).index
        if count[owner] < per_node:
            count[owner] += 1
            picked.append((slot, owner))
    return picked


# -- the harness itself, with plain redis-py ---------------------------------------------------
async def test_harness_migration_answers_ask_then_moved(empty: RedisCluster) -> None:
    client = ClusterClient.from_url(empty.url)
    try:
        keys = [f"{{tag}}:{i}".encode() for i in range(30)]  # one hash slot
        for i, k in enumerate(keys):
            await client.set(k, i.to_bytes(2, "big") * 100)
        slot = int(empty.nodes[0].cmd("CLUSTER", "KEYSLOT", keys[0]))
        src = empty.owner(slot)
        dst = empty.nodes[(src.index + 1) % 3]
        mig = empty.migration(slot, src, dst)
        await asyncio.to_thread(mig.begin)
        assert await asyncio.to_thread(mig.move, 10) == 10
        got = [await client.get(k) for k in keys]  # 10 answered by ASK from the old owner
        assert got == [i.to_bytes(2, "big") * 100 for i in range(30)]
        assert empty.redirections()["ASK"] >= 10
        while await asyncio.to_thread(mig.move, 7):
            pass
        await asyncio.to_thread(mig.finish)
        assert empty.owner(slot) is dst
        assert dst.keys_in_slot(slot, 100) and not src.keys_in_slot(slot, 100)
        got = [await client.get(k) for k in keys]  # the client's map is stale: MOVED
        assert got == [i.to_bytes(2, "big") * 100 for i in range(30)]
        assert empty.redirections()["MOVED"] >= 1
    finally:
        await client.aclose()


def test_harness_rejects_bad_migrations(cluster: RedisCluster) -> None:
    with pytest.raises(ValueError, match="slot"):
        cluster.migration(16384, cluster.nodes[0], cluster.nodes[1])
    with pytest.raises(ValueError, match="same node"):
        cluster.migration(0, cluster.nodes[0], cluster.nodes[0])


# -- RedisTier in cluster mode -----------------------------------------------------------------
async def test_round_trip_is_bit_exact_across_all_nodes(empty: RedisCluster) -> None:
    keys, data = page_keys(1), page_bytes(1)
    async with _tier(empty) as tier:
        assert await tier.lookup(keys) == 0
        await _publish(tier, keys, data)
        assert await tier.lookup(keys) == PAGES
        assert await tier.lookup([*keys[:7], page_keys(2)[0], *keys[7:]]) == 7
        local = np.full((2 * PAGES, SPEC.page_bytes), 0xA5, np.uint8)
        slots = list(range(2 * PAGES - 1, PAGES - 1, -1))
        assert await tier.load(keys, local, slots) == PAGES
        assert (local[slots] == data).all()
        assert (local[:PAGES] == 0xA5).all()  # rows not asked for are untouched
        stats = tier.stats()
        assert stats["hits"] >= PAGES and stats["corrupt"] == 0
    sizes = [int(n.cmd("DBSIZE")) for n in empty.nodes]
    assert all(sizes), f"pages not spread over every node: {sizes}"


def crowd(tier: RedisTier, slots: list[int], per_slot: int) -> list[bytes]:
    """``per_slot`` made-up page keys whose Redis keys hash to each of ``slots``: a slot that
    holds several pages can be caught half moved."""
    want = dict.fromkeys(slots, 0)
    out: list[bytes] = []
    i = 0
    while any(n < per_slot for n in want.values()):
        key = b"crowd-" + i.to_bytes(8, "big")
        slot = key_slot(tier.redis_key(key))
        if want.get(slot, per_slot) < per_slot:
            want[slot] += 1
            out.append(key)
        i += 1
    return out


async def _crowded(
    cluster: RedisCluster, tier: RedisTier, per_node: int
) -> tuple[list[bytes], Array, list[tuple[int, int]]]:
    """Publish PAGES content pages plus 5 more in each of ``per_node`` page-holding slots per
    node; returns all keys, their bytes and the crowded (slot, owner index) pairs."""
    await _publish(tier, page_keys(3), page_bytes(3))
    picked = _slot_of_each_node(cluster, per_node)
    assert {owner for _, owner in picked} == {0, 1, 2}
    extra = crowd(tier, [slot for slot, _ in picked], per_slot=5)
    await _publish(tier, extra, page_bytes(4, len(extra)))
    keys = [*page_keys(3), *extra]
    return keys, np.concatenate([page_bytes(3), page_bytes(4, len(extra))]), picked


async def _load_all(tier: RedisTier, keys: list[bytes], within: float = 20.0) -> Array:
    """Load every page, retrying while the tier backs off after a failure (bounded)."""
    local = np.zeros((len(keys), SPEC.page_bytes), np.uint8)
    deadline = asyncio.get_running_loop().time() + within
    while await tier.load(keys, local, list(range(len(keys)))) < len(keys):
        assert asyncio.get_running_loop().time() < deadline, f"pages unreadable: {tier.stats()}"
        await asyncio.sleep(0.1)
    return local


async def test_reads_follow_ask_while_a_slot_is_half_moved(empty: RedisCluster) -> None:
    # redis-py 8.1's asyncio cluster client may send ASKING and the command on two connections;
    # RedisTier follows ASK itself for the reads that came back as errors (redis_ask.py)
    async with _tier(empty) as tier:
        keys, data, picked = await _crowded(empty, tier, per_node=1)
        n = len(keys)
        assert (await _load_all(tier, keys) == data).all()
        warm = [np.zeros_like(data) for _ in range(4)]  # concurrent calls: a pool per node
        assert await asyncio.gather(*(tier.load(keys, w, list(range(n))) for w in warm)) == [n] * 4
        slot, owner = picked[0]
        src, dst = empty.nodes[owner], empty.nodes[(owner + 1) % 3]
        mig = empty.migration(slot, src, dst)
        await asyncio.to_thread(mig.begin)
        assert await asyncio.to_thread(mig.move, 3) == 3
        assert src.keys_in_slot(slot, 10) and dst.keys_in_slot(slot, 10)  # split over two
        local = np.zeros((n, SPEC.page_bytes), np.uint8)
        got = await tier.load(keys, local, list(range(n)))
        assert empty.redirections()["ASK"] >= 1
        assert got == n, f"{got}/{n} pages with a slot half moved: {tier.stats()}"
        assert (local == data).all()
        while await asyncio.to_thread(mig.move, 2):
            pass
        await asyncio.to_thread(mig.finish)
        local[:] = 0
        assert await tier.load(keys, local, list(range(n))) == n  # stale map: MOVED
        assert (local == data).all()
        assert empty.redirections()["MOVED"] >= 1


async def test_pages_survive_slot_migration_during_reads(empty: RedisCluster) -> None:
    async with _tier(empty) as tier:
        keys, data, picked = await _crowded(empty, tier, per_node=1)
        n = len(keys)
        assert (await _load_all(tier, keys) == data).all()
        reads = [0]  # loads completed (a load may miss pages of a moving slot, never garble)
        done = threading.Event()
        progress = threading.Condition()

        async def reader() -> None:
            buf = np.zeros((n, SPEC.page_bytes), np.uint8)
            try:
                while not done.is_set():
                    buf[:] = 0
                    got = await tier.load(keys, buf, list(range(n)))
                    assert 0 <= got <= n
                    assert (buf[:got] == data[:got]).all(), "a load returned wrong bytes"
                    with progress:
                        reads[0] += 1
                        progress.notify_all()
                    await asyncio.sleep(0.005)
            finally:
                done.set()  # a failed reader stops the migrations too
                with progress:
                    progress.notify_all()

        def reads_happen() -> None:  # between batches: let 2 loads see the slot half moved
            with progress:
                seen = reads[0]
                progress.wait_for(lambda: done.is_set() or reads[0] >= seen + 2, timeout=10)

        def migrate_all() -> None:
            try:
                for slot, owner in picked:  # each slot to the next node, 2 keys a batch
                    if done.is_set():
                        return
                    src, dst = empty.nodes[owner], empty.nodes[(owner + 1) % 3]
                    empty.migrate_slot(slot, src, dst, batch=2, between=reads_happen)
                    reads_happen()  # and with the slot moved (stale slot map: MOVED)
            finally:
                done.set()

        moving = asyncio.gather(reader(), reader(), asyncio.to_thread(migrate_all))
        await asyncio.wait_for(moving, 120)
        seen = empty.redirections()
        assert seen["ASK"] >= 1 and seen["MOVED"] >= 1, seen
        for slot, owner in picked:
            assert empty.owner(slot).index == (owner + 1) % 3
            assert not empty.nodes[owner].keys_in_slot(slot, 1)
        assert (await _load_all(tier, keys) == data).all()
        assert tier.stats()["corrupt"] == 0
    async with _tier(empty) as tier:  # a fresh client (no stale slot map) reads them all too
        assert (await _load_all(tier, keys) == data).all()
