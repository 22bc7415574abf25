"""The cluster directory in Redis (tierkv.remote.membership): registration, liveness, publish,
locate, sweep, faults and bad configuration, against a private redis-server (and a 3-node
Redis Cluster for the hash-tagged layout)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, free_port, skip_without_redis

from tierkv.errors import InvalidInputError
from tierkv.remote.errors import (
    DirectoryAuthError,
    DirectoryError,
    DirectoryURLError,
    NodeIdTakenError,
)
from tierkv.remote.membership.agent import DirectoryAgent
from tierkv.remote.membership.redis_directory import RedisDirectory, check_url

TTL = 0.5


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    """``n`` content keys (top bit clear), the same for a seed."""
    rnd = __import__("random").Random(seed)
    return [bytes([rnd.randrange(128)]) + rnd.randbytes(15) for _ in range(n)]


skip_without_redis()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:  # one per module; `fresh` empties it for each test
        yield srv


@pytest.fixture
async def fresh(server: RedisServer) -> AsyncIterator[str]:
    """The module's server, emptied."""
    if not server.running:
        server.restart()
    d = RedisDirectory(server.url)
    await d.connect()
    await d.client.flushall()
    await d.aclose()
    yield server.url


async def directory(url: str, **kw: object) -> RedisDirectory:
    return await RedisDirectory(url, ttl=TTL, **kw).connect()  # type: ignore[arg-type]


async def test_publish_locate_withdraw(fresh: str) -> None:
    d = await directory(fresh)
    try:
        a, b = await d.register("a:1"), await d.register("b:2")
        keys = keys_of(3000)
        assert await d.publish(a, keys) == 3000
        assert await d.publish(a, keys[:10]) == 0  # idempotent
        assert await d.publish(b, keys[:10]) == 10
        got = await d.locate(keys + keys_of(5, seed=9))
        assert got[:10] == [("a:1", "b:2")] * 10
        assert got[10:3000] == [("a:1",)] * 2990 and got[3000:] == [()] * 5
        await d.publish(a, [], keys[:20])  # pages leave a
        got = await d.locate(keys[:30])
        assert got == [("b:2",)] * 10 + [()] * 10 + [("a:1",)] * 10
        pages = [k + bytes((layer, 0)) for k in keys_of(20, seed=4) for layer in range(2)]
        mixed = keys_of(20, seed=5) + pages  # 16- and 18-byte keys in one call
        assert await d.publish(b, mixed, keys[:5]) == 60
        got = await d.locate(mixed + keys[:6])
        assert got == [("b:2",)] * 60 + [()] * 5 + [("b:2",)]
        assert await d.locate(pages) == [("b:2",)] * 40  # 18 bytes alone (end to end)
        with pytest.raises(InvalidInputError):
            await d.publish(a, [b"\x80" * 16])  # a private key
        with pytest.raises(InvalidInputError):
            await d.locate([b"short"])
    finally:
        await d.aclose()


async def test_a_node_that_leaves_or_lapses_is_never_answered_and_is_swept(fresh: str) -> None:
    d = await directory(fresh)
    try:
        a, b = await d.register("a:1"), await d.register("b:2")
        keys = keys_of(500)
        await d.publish(a, keys)
        await d.publish(b, keys[:100])
        await d.leave(a, "a:1")
        assert await d.locate(keys[:101]) == [("b:2",)] * 100 + [()]
        await asyncio.sleep(TTL + 0.1)  # b stops refreshing: it lapses
        assert await d.locate(keys[:100]) == [()] * 100
        assert await d.live() == {}
        assert not await d.refresh(b, "b:2")  # lapsed: register again (a new number)
        assert await d.sweep() == 600  # a's (it left) and b's (lapsed: found by the refresh)
        assert await d.sweep() == 0
        # the buckets are empty: nothing left in Redis but the membership keys
        assert sorted(await d.client.keys(b"tkv:dir:{s*")) == []
    finally:
        await d.aclose()


async def test_a_restarted_node_never_answers_its_former_entries(fresh: str) -> None:
    d = await directory(fresh)
    try:
        old = await d.register("a:1")
        keys = keys_of(50)
        await d.publish(old, keys)
        # the process dies (no leave) and starts again: it waits out its former self
        new = await d.register("a:1")
        assert new != old
        assert await d.locate(keys) == [()] * 50  # the former entries: not answered
        await d.publish(new, keys[:5])
        assert await d.locate(keys[:6]) == [("a:1",)] * 5 + [()]
        assert not await d.refresh(old, "a:1")  # the former self, if it still ran: replaced
    finally:
        await d.aclose()


async def test_an_address_held_by_a_live_node_is_refused(fresh: str) -> None:
    d = await directory(fresh)
    try:
        n = await d.register("a:1")

        async def keep() -> None:
            while True:
                assert await d.refresh(n, "a:1")
                await asyncio.sleep(TTL / 4)

        keeper = asyncio.ensure_future(keep())
        try:
            with pytest.raises(NodeIdTakenError, match="a:1"):
                await d.register("a:1")
        finally:
            keeper.cancel()
        assert await d.live() == {n: "a:1"}
    finally:
        await d.aclose()


@pytest.mark.parametrize(
    "url",
    ["http://h:1", "redis://h:port/0", "redis://h:1/zz", "redis://h:99999/0", "redis:///0", ""],
)
def test_a_bad_url_is_a_typed_error(url: str) -> None:
    with pytest.raises(DirectoryURLError):
        check_url(url)
    with pytest.raises(ValueError):  # also a ValueError (InvalidInputError)
        RedisDirectory(url)


@pytest.mark.parametrize(
    "kw",
    [
        {"ttl": "5"},  # a TypeError of the range check
        {"timeout": None},
        {"buckets": 2.5},  # an AttributeError (bit_length)
        {"shards": "3"},
        {"ttl": True},
        {"namespace": 5},  # a TypeError inside re
        {"ttl": float("nan")},
    ],
)
def test_bad_directory_options_are_typed_errors(kw: dict[str, object]) -> None:
    with pytest.raises(DirectoryURLError):
        RedisDirectory("redis://127.0.0.1:1/0", **kw)  # type: ignore[arg-type]


def test_good_urls_parse() -> None:
    for url in ("redis://:pw@h:1/0", "rediss://user:pw@h:6380/2", "redis://h", "unix:///tmp/r"):
        check_url(url)


async def test_refused_auth_and_unreachable_are_typed_errors_at_start() -> None:
    with RedisServer() as srv:
        host_port = srv.url.split("//")[1]
        d = await directory(srv.url)
        await d.client.config_set("requirepass", "s3cret")
        await d.aclose()
        with pytest.raises(DirectoryAuthError):
            await directory(f"redis://{host_port}")  # no password
        with pytest.raises(DirectoryAuthError):
            await directory(f"redis://:wrong@{host_port}")
        d = await directory(f"redis://:s3cret@{host_port}")
        assert await d.register("a:1") > 0
        await d.aclose()
    with pytest.raises(DirectoryError, match="cannot reach"):
        await directory(f"redis://127.0.0.1:{free_port()}/0")


async def test_an_unreachable_directory_logs_one_line_per_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`tierkv serve --directory <unreachable>`: each retry's warning was a page of redis-py
    frames (exc_info). Now one line per failure (rate limited as before); the traceback only
    in a DEBUG record of its own."""
    agent = DirectoryAgent(
        RedisDirectory(f"redis://127.0.0.1:{free_port()}/0", ttl=TTL, timeout=0.2),
        "a:1",
        set,
        linger=0,
        backoff_cap=0.05,
    )
    with caplog.at_level(logging.DEBUG, logger="tierkv.remote.directory"):
        await agent.start()  # warned about, not raised: serving does not need the directory
        try:
            await until_true(lambda: agent.errors >= 3)
        finally:
            await agent.aclose()
    got = [r for r in caplog.records if r.name == "tierkv.remote.directory"]
    warned = [r for r in got if r.levelno == logging.WARNING]
    assert warned and all(r.exc_info is None for r in warned)
    assert all("\n" not in r.getMessage() and "directory" in r.getMessage() for r in warned)
    debug = [r for r in got if r.levelno == logging.DEBUG]
    assert len(debug) == len(warned) and all(r.exc_info is not None for r in debug)


async def test_agent_publishes_changes_and_leaves(fresh: str) -> None:
    held: set[bytes] = set(keys_of(100))
    agent = DirectoryAgent(RedisDirectory(fresh, ttl=TTL), "a:1", lambda: set(held), linger=0)
    reader = await directory(fresh)
    try:
        await agent.start()
        agent.changed()
        await until(lambda: reader.locate(sorted(held)), [("a:1",)] * 100)
        gone = sorted(held)[:30]
        held.difference_update(gone)
        agent.changed()
        await until(lambda: reader.locate(gone), [()] * 30)
        await asyncio.sleep(TTL * 2)  # refreshed meanwhile: still live
        assert await reader.locate(sorted(held)) == [("a:1",)] * 70
        await agent.aclose()
        assert await reader.locate(sorted(held)) == [()] * 70  # left: at once
    finally:
        await agent.aclose()
        await reader.aclose()


async def test_agent_rides_out_redis_down_and_republishes_in_full(
    server: RedisServer, fresh: str, caplog: pytest.LogCaptureFixture
) -> None:
    held = set(keys_of(200))
    agent = DirectoryAgent(
        RedisDirectory(fresh, ttl=TTL, timeout=0.2), "a:1", lambda: set(held), linger=0
    )
    await agent.start()
    try:
        agent.changed()
        reader = await directory(fresh)
        await until(lambda: reader.locate(sorted(held)), [("a:1",)] * 200)
        await reader.aclose()
        with caplog.at_level(logging.WARNING, logger="tierkv.remote.directory"):
            server.kill()  # everything Redis had is gone (nothing saved)
            held.update(keys_of(10, seed=5))
            agent.changed()
            await until_true(lambda: agent.errors > 0)
            server.restart()
            reader = await directory(fresh)
            try:  # back: registered again under a new number, the full set published
                await until(lambda: reader.locate(sorted(held)), [("a:1",)] * 210)
            finally:
                await reader.aclose()
        assert agent.number and agent.registrations >= 2  # (numbers restart at the clock)
        assert any("directory" in r.getMessage() for r in caplog.records)
    finally:
        await agent.aclose()


async def test_agent_start_refuses_a_taken_address(fresh: str) -> None:
    a = DirectoryAgent(RedisDirectory(fresh, ttl=TTL), "a:1", set)
    await a.start()
    try:
        b = DirectoryAgent(RedisDirectory(fresh, ttl=TTL), "a:1", set)
        with pytest.raises(NodeIdTakenError):
            await b.start()
        await b.aclose()
    finally:
        await a.aclose()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "drop", "leave"]), st.integers(0, 2), st.sets(st.integers(0, 15))
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None)
@given(ops=_ops)
def test_locate_matches_a_model(server: RedisServer, ops: list[tuple[str, int, set[int]]]) -> None:
    """Publish / withdraw / leave against a plain model: per key, the live nodes holding it."""
    keys = keys_of(16, seed=3)

    async def run() -> None:
        d = RedisDirectory(server.url, ttl=30, namespace=f"model{os.getpid()}")
        await d.connect()
        try:
            await d.client.flushall()
            nodes = [await d.register(f"n:{i + 1}") for i in range(3)]
            model: list[set[int]] = [set(), set(), set()]
            for op, node, ks in ops:
                if op == "add":
                    await d.publish(nodes[node], [keys[k] for k in ks])
                    model[node] |= ks
                elif op == "drop":
                    await d.publish(nodes[node], [], [keys[k] for k in ks])
                    model[node] -= ks
                else:
                    await d.leave(nodes[node], f"n:{node + 1}")
                    nodes[node] = await d.register(f"n:{node + 1}")
                    model[node] = set()
                    if ks:
                        await d.sweep()
                got = await d.locate(keys)
                want = [sorted(f"n:{i + 1}" for i in range(3) if k in model[i]) for k in range(16)]
                assert [sorted(g) for g in got] == want
        finally:
            await d.aclose()

    asyncio.run(run())


async def until(get: object, want: object, bound: float = 10.0) -> None:
    """Wait (bounded) for ``await get()`` to equal ``want``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    got = None
    while loop.time() < deadline:
        got = await get()  # type: ignore[operator]
        if got == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {bound} s: {str(got)[:200]}")


async def until_true(cond: object, bound: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not cond():  # type: ignore[operator]
        assert loop.time() < deadline, f"not within {bound} s"
        await asyncio.sleep(0.02)


async def test_cluster_mode_spreads_shards_and_answers_the_same() -> None:
    """On a 3-node Redis Cluster: detected at connect, buckets in 16 hash-tagged shards (every
    script touches one slot), the same answers as on one server."""
    from redis_cluster import RedisCluster, available

    why_not = available()
    if why_not is not None:
        pytest.skip(why_not)
    with RedisCluster(3) as cluster:
        d = await RedisDirectory(cluster.url, ttl=TTL).connect()
        try:
            assert d.cluster and d.layout.shards == 16
            a, b = await d.register("a:1"), await d.register("b:2")
            keys = keys_of(2000)
            assert await d.publish(a, keys) == 2000
            assert await d.publish(b, keys[:7]) == 7
            await d.publish(a, [], keys[:3])
            got = await d.locate(keys)
            assert got[:3] == [("b:2",)] * 3 and got[3:7] == [("a:1", "b:2")] * 4
            assert got[7:] == [("a:1",)] * 1993
            await d.leave(a, "a:1")
            assert await d.locate(keys[:8]) == [("b:2",)] * 7 + [()]
            assert await d.sweep() == 1997
            owners = {
                cluster.owner(s).port for s in {_slot(d.layout.shard_prefix(i)) for i in range(16)}
            }
            assert len(owners) > 1  # the shards are spread over the nodes
        finally:
            await d.aclose()


def _slot(name: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(name.encode()))


async def test_a_publish_whose_reply_is_lost_is_set_right(fresh: str) -> None:
    """A call that landed in Redis but whose reply was lost (a timeout after the write): its
    keys are uncertain, and the next call withdraws those no longer held and adds the rest,
    under the same number (no new registration for a blip)."""
    held = set(keys_of(40))
    d = RedisDirectory(fresh, ttl=5.0)
    agent = DirectoryAgent(d, "a:1", lambda: set(held), linger=0, backoff_cap=0.05)
    real = d.publish
    lost = []

    async def landed_then_lost(number: int, add: object, drop: object = ()) -> int:
        n = await real(number, add, drop)  # type: ignore[arg-type]
        if not lost:
            lost.append(n)
            raise TimeoutError("reply lost")
        return n

    d.publish = landed_then_lost  # type: ignore[method-assign]
    reader = await directory(fresh)
    try:
        await agent.start()
        number = agent.number
        agent.changed()
        await until_true(lambda: bool(lost))
        gone = sorted(held)[:10]
        held.difference_update(gone)  # left while their publish was uncertain
        agent.changed()
        await until(lambda: reader.locate(gone + sorted(held)), [()] * 10 + [("a:1",)] * 30)
        assert agent.number == number and agent.errors == 1 and not agent.uncertain
    finally:
        await agent.aclose()
        await reader.aclose()


def test_the_page_server_and_cluster_need_redis_only_with_a_directory() -> None:
    """The directory needs the `redis` extra; importing tierkv.remote, the page server and
    RemoteCluster does not load redis (it is imported when a directory is given)."""
    import subprocess

    code = (
        "import sys, tierkv.remote, tierkv.remote.server.page_server, "
        "tierkv.remote.sources.cluster; print('redis' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-500:]


@pytest.mark.parametrize(("buckets", "shards"), [(1 << 16, 1), (1 << 10, 1), (1 << 16, 16)])
def test_locate_requests_name_each_keys_bucket(buckets: int, shards: int) -> None:
    """Layout.records and Layout.hgets (C slices per byte column) name the same bucket as
    bucket_of, for every mask and shard, keys of one length or mixed; pack refuses what
    check_keys refuses."""
    from tierkv.remote.membership.layout import Layout, blob, pack, resp

    lay = Layout("t:ns", buckets, shards)
    same, mixed = keys_of(300, seed=4), keys_of(5, seed=5) + [k + b"\x01\x00" for k in keys_of(5)]
    for keys in (same, mixed):
        joined, fixed = pack(keys)
        assert (joined, fixed) == (blob(keys, fixed), 16 if keys is same else 0)
        shard = lay.shard_of(keys[0])
        got = lay.records(shard, joined, fixed, keys)
        want = b"".join(
            lay.shard_prefix(shard).encode()
            + lay.bucket_of(k)[-2:]
            + (b"" if fixed else bytes((len(k),)))
            + k
            for k in keys
        )
        assert got == want
        hgets = b"".join(resp(b"HGET", lay.bucket_of(k), k) for k in keys)
        assert bytes(lay.hgets(joined, fixed, keys)) == hgets  # (a standalone server's)
    private = bytes([0x80]) + same[0][1:]
    for bad in ([*same[:3], private], [bytearray(same[0])], [same[0][:15]], [b"\x00" * 256]):
        with pytest.raises(InvalidInputError):
            pack(bad)  # type: ignore[arg-type]


async def test_locate_on_a_small_layout_in_several_scripts(fresh: str) -> None:
    """Buckets under 65,536 (byte 9 masked), 2,500 keys (three scripts), mixed holders."""
    d = await directory(fresh, buckets=1 << 10)
    try:
        a, b = await d.register("a:1"), await d.register("b:2")
        keys = keys_of(2500, seed=6)
        await d.publish(a, keys[:2000])
        await d.publish(b, keys[1000:])
        got = await d.locate(keys)
        assert got == [("a:1",)] * 1000 + [("a:1", "b:2")] * 1000 + [("b:2",)] * 500
        await d.leave(a, "a:1")
        assert await d.locate(keys[900:1100]) == [()] * 100 + [("b:2",)] * 100
        numbers, live = await d.holders(keys[1999:2001])
        assert (numbers, live) == ([(b,), (b,)], {b: "b:2"})
    finally:
        await d.aclose()


async def test_halt_ends_a_loop_whose_cancellation_a_call_swallowed(
    fresh: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: halt() cancelled the agent's tasks and waited for them; a refresh whose
    cancellation came back as a Redis error (caught by the keepalive, as every failure is) kept
    the loop going: halt() never returned and the registration it meant to let lapse stayed
    refreshed (two of 16 nodes hung so in every run of benchmarks/directory.py's churn)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    d = RedisDirectory(fresh, ttl=0.3, timeout=2.0)
    agent = await DirectoryAgent(d, "127.0.0.1:17999", set, linger=0).start()
    started = asyncio.Event()

    async def swallowing(number: int, address: str) -> bool:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed mid-call") from None
        return True

    monkeypatch.setattr(d, "refresh", swallowing)
    await asyncio.wait_for(started.wait(), 5)  # the keepalive is inside the call
    await asyncio.wait_for(agent.halt(), 5)  # hung before the fix (the test with it)


async def test_halt_is_bounded_when_a_call_ignores_its_cancellation(
    fresh: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh that swallows every cancel (not only the first) until it is let go: halt()
    returns within the directory's timeout, the loop left to end at its next turn. Fails on
    the old code (halt waited for the cancelled tasks without bound)."""
    d = RedisDirectory(fresh, ttl=0.3, timeout=0.5)
    agent = await DirectoryAgent(d, "127.0.0.1:17998", set, linger=0).start()
    started, gate = asyncio.Event(), asyncio.Event()

    async def deaf(number: int, address: str) -> bool:
        started.set()
        while not gate.is_set():
            try:
                await gate.wait()
            except asyncio.CancelledError:
                continue
        return True

    monkeypatch.setattr(d, "refresh", deaf)
    await asyncio.wait_for(started.wait(), 5)  # the keepalive is inside the call
    halting = asyncio.ensure_future(agent.halt())
    done, _ = await asyncio.wait([halting], timeout=10)
    gate.set()  # (the loop ends now: it sees the agent closing)
    assert done, "halt waited for a task that ignored its cancellation"
    halting.result()


@pytest.mark.parametrize(
    "address",
    ["", "nohost", "h:0", "h:99999", "h:port", "x" * 300 + ":80", 5, None, b"h:1"],
    ids=lambda a: repr(a)[:12],
)
async def test_an_address_no_client_could_reach_is_never_registered(
    fresh: str, address: object
) -> None:
    """Each was registered, and every locate answered it as a holder of what it published
    (clients then failed against it, each in turn)."""
    d = await directory(fresh)
    try:
        with pytest.raises(InvalidInputError):  # (InvalidTypeError is one too)
            await d.register(address)  # type: ignore[arg-type]
        assert await d.live() == {}
        assert await d.register("h:1") >= 0  # a good one still registers
    finally:
        await d.aclose()


async def test_entries_another_writer_put_in_redis_are_never_answered(fresh: str) -> None:
    """Live nodes whose address no client could reach (or whose number tierkv never issues),
    written into Redis by another writer, listed first among a key's holders: `live` and
    `locate` answer the good holder only and count the rest (before: `live` raised
    InvalidResponse for the bad numbers, and the bad addresses were answered first, tried
    and refused by every client each time)."""
    from redis.asyncio import Redis

    bad = [b"", b"h", b"h:0", b"h:99999", b":1", b"\xff\xfe:1", b"h" * 300 + b":1"]
    d, raw = await directory(fresh), Redis.from_url(fresh)
    try:
        good = await d.register("good:1")
        keys = keys_of(5, seed=3)
        assert len({d.layout.bucket_of(k) for k in keys}) == 5
        await d.publish(good, keys[:3])
        lay, forever = d.layout, 1 << 50  # an expiry far ahead (ms): live
        numbers = list(range(10, 10 + len(bad)))
        for n, address in zip(numbers, bad):
            await raw.zadd(lay.alive, {n: forever})
            await raw.hset(lay.addr, n, address)
        for n in ("4294967296", "not-a-number"):
            await raw.zadd(lay.alive, {n: forever})
            await raw.hset(lay.addr, n, "fine:1")
        first = b"".join(n.to_bytes(4, "little") for n in numbers)
        for k in keys[:3]:
            await raw.hset(lay.bucket_of(k), k, first + good.to_bytes(4, "little"))
        await raw.hset(lay.bucket_of(keys[3]), keys[3], b"\x01\x02\x03")  # no whole number
        await raw.set(lay.bucket_of(keys[4]), b"not a hash")  # WRONGTYPE for its HGET

        per_live = len(bad) + 2
        assert await d.live() == {good: "good:1"}
        assert d.stats() == {"directory_refused_entries_total": per_live}
        assert await d.locate(keys) == [("good:1",)] * 3 + [(), ()]
        assert d.refused_entries == 2 * per_live + 2
        holders, live = await d.holders(keys)
        assert holders == [(good,)] * 3 + [(), ()] and live == {good: "good:1"}
    finally:
        await raw.aclose()
        await d.aclose()


async def test_the_locate_script_takes_values_another_writer_put_as_no_holders(
    fresh: str,
) -> None:
    """A Redis Cluster's locate (the LOCATE script, run here on the standalone server as on a
    shard): a value of no whole node numbers, of over 65,535 of them, and a bucket that is no
    hash are no holders, counted, the other keys answered (before: the script failed, or its
    reply was refused whole, for the 1,000 keys of its batch)."""
    from redis.asyncio import Redis

    from tierkv.remote.membership.layout import LOCATE, pack
    from tierkv.remote.membership.redis_directory import _answers
    from tierkv.remote.membership.replies import script_reply

    d, raw = await directory(fresh), Redis.from_url(fresh)
    try:
        good = await d.register("good:1")
        lay, me = d.layout, good.to_bytes(4, "little")
        keys = keys_of(5, seed=5)
        assert len({lay.bucket_of(k) for k in keys}) == 5
        await d.publish(good, [keys[0], keys[4]])
        await raw.hset(lay.bucket_of(keys[1]), keys[1], me + b"\x01\x02\x03")
        await raw.set(lay.bucket_of(keys[2]), b"not a hash")
        await raw.hset(lay.bucket_of(keys[3]), keys[3], me * 65536)
        blob, fixed = pack(keys)
        prefix = lay.shard_prefix(0)
        records = lay.records(0, blob, fixed, keys)
        reply = await raw.eval(LOCATE, 1, prefix, len(prefix.encode()) + 2, fixed, records)
        counts, held, refused = script_reply(reply)
        assert refused == 3
        got = _answers(len(keys), [(None, counts, held)], {good: "good:1"}.get)
        assert got == [("good:1",), (), (), (), ("good:1",)]
    finally:
        await raw.aclose()
        await d.aclose()
