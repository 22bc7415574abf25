"""A hostile server behind the directory's URL (membership/wire.py, replies.py): whatever it
answers, a locate's trip ends with a RedisError (InvalidResponse: the type the directory's
callers count and ride out) within its bytes and its time, its connection closed; hostile
shapes of the live set and of the entries are InvalidResponse too, never a TypeError,
IndexError, struct.error or MemoryError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

pytest.importorskip("redis")
pytest.importorskip("hiredis")
from redis.exceptions import InvalidResponse, ResponseError

from tierkv.remote.membership.layout import resp
from tierkv.remote.membership.redis_directory import _answers, _by_value
from tierkv.remote.membership.replies import (
    MAX_ELEMENTS,
    AggregateGuard,
    live_set,
    script_reply,
    suspect,
)
from tierkv.remote.membership.wire import Links, Where, reply_bytes

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Callable[[Handler], Awaitable[Where]], list[str]]]:
    """A TCP server answering as the handler says (not Redis); ``ended`` lists how each
    connection ended on the server's side."""
    servers: list[asyncio.Server] = []
    ended: list[str] = []

    async def start(handler: Handler) -> Where:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await handler(reader, writer)
                await reader.read()  # until the client closes
                ended.append("closed")
            except (ConnectionError, OSError):
                ended.append("reset")
            finally:
                writer.close()

        srv = await asyncio.start_server(run, "127.0.0.1", 0)
        servers.append(srv)
        return Where(host="127.0.0.1", port=srv.sockets[0].getsockname()[1])

    yield start, ended
    for srv in servers:
        srv.close()


def answering(answer: bytes, then: bytes = b"") -> Handler:
    """Send ``answer`` after the request, then ``then`` over and over (b"": nothing more)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(answer)
        await writer.drain()
        while then:
            writer.write(then)
            await writer.drain()

    return handler


async def _closed(ended: list[str], n: int = 1) -> None:
    for _ in range(200):
        if len(ended) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the server saw {ended}: the client kept its connection")


HUGE = [
    b"*4294967295\r\n:1\r\n",  # hiredis asked 32 GiB for it: MemoryError
    b"*2147483647\r\n" * 7 + b":1\r\n",  # nested, 16 GiB a level
    b"+OK\r\n*1000001\r\n",  # the second reply (an HGET's place)
    b"$8\r\n*9999999\r\n*2000000\r\n",  # a payload that looks like one, then a real one
    b"%2000000\r\n",
    b"~2000000\r\n",
    b">2000000\r\n",
]


@pytest.mark.parametrize("answer", HUGE, ids=range(len(HUGE)))
async def test_a_huge_aggregate_is_refused_before_it_is_allocated(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], answer: bytes
) -> None:
    start, ended = fake
    links = Links(await start(answering(answer)), timeout=10.0)
    with pytest.raises(InvalidResponse, match="aggregate"):
        await links.trip(resp("PING") * 2, 2)
    await _closed(ended)
    await links.aclose()


@pytest.mark.parametrize(
    ("answer", "then"),
    [
        (b"$1099511627776\r\n", b"x" * (1 << 16)),  # a bulk that never ends
        (b"+" + b"y" * 100, b"y" * (1 << 16)),  # a line that never ends
        (b"*999999\r\n", b"$1000\r\n" + b"z" * 1000 + b"\r\n"),  # an array of big elements
    ],
    ids=["bulk", "line", "elements"],
)
async def test_a_reply_past_its_bytes_is_cut_off(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], answer: bytes, then: bytes
) -> None:
    """The server sends without end: the trip stops at its bound of bytes (not its 30 s
    deadline) and closes the connection."""
    start, ended = fake
    links = Links(await start(answering(answer, then)), timeout=30.0)
    with pytest.raises(InvalidResponse, match="bytes of replies"):
        await links.trip(resp("PING"), 1)
    await _closed(ended)
    await links.aclose()


@pytest.mark.parametrize(
    "answer", [b"$-5\r\n", b"*-5\r\n", b"*99999999999999999999\r\n", b"$abc\r\n", b":1x\r\n"]
)
async def test_bad_lengths_are_invalid_responses(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], answer: bytes
) -> None:
    start, ended = fake
    links = Links(await start(answering(answer)), timeout=10.0)
    with pytest.raises(InvalidResponse):
        await links.trip(resp("PING"), 1)
    await _closed(ended)


def test_the_bounds_let_a_real_locate_through() -> None:
    """1,000 keys each held by 16 nodes, and a live set of 10,000 nodes, fit the bytes; a
    payload with an aggregate's look is walked past, not refused."""
    entry = b"$64\r\n" + bytes(64) + b"\r\n"
    live = b"*20000\r\n" + b"$5\r\n12345\r\n$15\r\n10.0.0.1:760000\r\n" * 10_000
    assert len(live) + 1000 * len(entry) <= reply_bytes(1001)
    stream = live + b"$8\r\n*1234567\r\n" + entry * 999
    assert suspect(stream)
    guard = AggregateGuard()
    for at in range(0, len(stream), 7):  # in pieces that split headers and payloads
        guard.feed(stream[at : at + 7])
    assert MAX_ELEMENTS >= 20_000


@pytest.mark.parametrize("flat", [5, b"x", [b"1"], [b"1", b"a:1", b"2"]])
def test_a_live_set_of_no_pairs_is_an_invalid_response(flat: object) -> None:
    with pytest.raises(InvalidResponse):
        live_set(flat)


@pytest.mark.parametrize(
    ("number", "address"),
    [
        (b"one", b"a:1"),
        ([b"1"], b"a:1"),
        (b"4294967296", b"a:1"),
        (b"-1", b"a:1"),
        (b"1", 7),
        (b"1", b"\xff\xfe:1"),
        (b"1", b"a"),
        (b"1", b""),
        (b"1", b"a:0"),
        (b"1", b"a:99999"),
        (b"1", b"h" * 300 + b":1"),
    ],
)
def test_an_entry_tierkv_never_writes_is_left_out_of_the_live_set(
    number: object, address: object
) -> None:
    """Each was an InvalidResponse (every locate failed while it was there) or answered as a
    holder's address (a client refused it, and tried it again first each time)."""
    flat = [b"2", b"b:2", number, address, b"3", b"c:3"]
    assert live_set(flat) == ({2: "b:2", 3: "c:3"}, 1)


def test_the_live_set_and_an_error_reply() -> None:
    assert live_set([b"1", b"a:1", b"2", b"b:2"]) == ({1: "a:1", 2: "b:2"}, 0)
    with pytest.raises(ResponseError):
        live_set(ResponseError("NOSCRIPT"))


@pytest.mark.parametrize("value", [[b"\x01\x00\x00\x00"], 5, "str", ResponseError("OOM")])
def test_a_hostile_entry_is_an_invalid_response(value: object) -> None:
    with pytest.raises((InvalidResponse, ResponseError)):
        _by_value([b"\x01\x00\x00\x00", value], {1: "a:1"})


@pytest.mark.parametrize("value", [b"\x01\x00\x00", b"\x01", ResponseError("WRONGTYPE x")])
def test_an_entry_another_writer_could_leave_is_no_holders(value: object) -> None:
    """A value of no whole node numbers, or a bucket that is no hash: counted, no holders
    (each was an InvalidResponse: the locate of every key beside it failed)."""
    got = _by_value([b"\x01\x00\x00\x00", value, None], {1: "a:1"})
    assert got == ([("a:1",), (), ()], 1)


@pytest.mark.parametrize(
    "reply",
    [
        5,
        [b"\x01\x00"],
        [b"\x01\x00", b"\x01\x00\x00\x00"],  # no count of entries left out
        [b"\x01", b"\x01\x00\x00\x00", 0],  # half a count
        [b"\x01\x00", b"\x01\x00\x00", 0],  # three bytes of a holder
        [b"\x02\x00", b"\x01\x00\x00\x00", 0],  # two holders counted, one sent
        [[b"\x01\x00"], b"\x01\x00\x00\x00", 0],
        [b"\x01\x00", b"\x01\x00\x00\x00", -1],
        [b"\x01\x00", b"\x01\x00\x00\x00", b"x"],
    ],
)
def test_a_hostile_script_reply_is_an_invalid_response(reply: object) -> None:
    with pytest.raises(InvalidResponse):
        script_reply(reply)
    counts, held, refused = script_reply([b"\x01\x00\x02\x00", b"\x01\x00\x00\x00" * 3, 2])
    assert refused == 2
    assert _answers(2, [(None, counts, held)], {1: "a"}.get) == [("a",), ("a", "a")]


@pytest.mark.parametrize(
    "conf",
    [
        {"buckets": "many", "shards": "1"},  # ValueError
        {"buckets": "0", "shards": "1"},  # ZeroDivisionError at the first locate
        {"buckets": "16", "shards": "0"},
        {"buckets": str(1 << 40), "shards": "1"},
        {"shards": "1", "other": "x"},  # buckets missing: set again by hsetnx, taken
    ],
)
async def test_a_layout_tierkv_never_writes_is_a_directory_error(conf: dict[str, str]) -> None:
    """The conf hash of the namespace (written by whoever shares the Redis) is checked
    against the constructor's bounds: a DirectoryError at connect, not a ValueError or a
    ZeroDivisionError later."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from redis.asyncio import Redis
    from redis_server import RedisServer, skip_without_redis

    from tierkv.remote.errors import DirectoryError
    from tierkv.remote.membership.redis_directory import RedisDirectory

    skip_without_redis()
    with RedisServer() as srv:
        d = RedisDirectory(srv.url, ttl=5.0)
        raw = await Redis.from_url(srv.url)
        try:
            await raw.hset(d.layout.conf, mapping=conf)
            if "buckets" not in conf:  # (hsetnx fills a missing field: a usable layout)
                await (await d.connect()).locate([bytes(16)])
                return
            with pytest.raises(DirectoryError, match="layout"):
                await d.connect()
        finally:
            await d.aclose()
            await raw.aclose()


async def test_a_trip_of_zero_replies_ends(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]],
) -> None:
    """An integer reply of 0 is a reply: the parser's 'no reply yet' was False (== 0), so a
    trip whose replies were ``:0`` waited for more until its deadline (publish's and
    sweep's scripts answer 0 often, now that they go on these connections)."""
    start, _ = fake
    links = Links(await start(answering(b":0\r\n:1\r\n:0\r\n")), timeout=5.0)
    assert await links.trip(resp("PING") * 3, 3) == [0, 1, 0]
    await links.aclose()


def redis_like(answers: dict[bytes, bytes]) -> Handler:
    """Answer each command by its name from ``answers`` (a RESP reply), the others ``+OK``."""
    import hiredis

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        while data := await reader.read(1 << 16):
            parser.feed(data)
            while (cmd := parser.gets()) is not False:
                writer.write(answers.get(bytes(cmd[0]).upper(), b"+OK\r\n"))
            await writer.drain()

    return handler


STANDALONE = {
    b"INFO": b"$30\r\n# Cluster\r\ncluster_enabled:0\r\n\r\n",
    b"HSETNX": b":0\r\n",
    b"HGETALL": b"*4\r\n$7\r\nbuckets\r\n$2\r\n16\r\n$6\r\nshards\r\n$1\r\n1\r\n",
}


@pytest.mark.parametrize("hostile", [b"INFO", b"HGETALL", b"EVALSHA", b"SRANDMEMBER"])
async def test_every_call_of_the_directory_is_bounded_on_a_standalone_server(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], hostile: bytes
) -> None:
    """A hostile server behind the directory's URL answering connect's INFO or HGETALL, the
    agent's register / publish (EVALSHA) or a sweep's SRANDMEMBER with ``*4294967295``:
    these went through redis-py, whose hiredis parser allocated the announced 32 GiB
    (MemoryError, or the box's memory). Now every call of a standalone server goes on the
    directory's own bounded connections: a DirectoryError at connect, InvalidResponse (a
    RedisError the agent counts and rides out) after, the connection closed."""
    from tierkv.remote.errors import DirectoryError
    from tierkv.remote.membership.redis_directory import RedisDirectory

    start, ended = fake
    answers = {**STANDALONE, hostile: HUGE[0]}
    at = await start(redis_like(answers))
    d = RedisDirectory(f"redis://127.0.0.1:{at.port}/0", ttl=5.0, timeout=5.0)
    try:
        if hostile in (b"INFO", b"HGETALL"):
            with pytest.raises(DirectoryError, match="aggregate"):
                await d.connect()
            return
        await d.connect()
        with pytest.raises(InvalidResponse, match="aggregate"):
            if hostile == b"EVALSHA":
                await d.register("a:1")
            else:
                await d.sweep()
        await _closed(ended)
    finally:
        await d.aclose()


async def test_a_sweep_of_a_dead_set_tierkv_never_writes_is_an_invalid_response(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]],
) -> None:
    from tierkv.remote.membership.redis_directory import RedisDirectory

    start, _ = fake
    at = await start(redis_like({**STANDALONE, b"SRANDMEMBER": b"*1\r\n$3\r\nabc\r\n"}))
    d = await RedisDirectory(f"redis://127.0.0.1:{at.port}/0", ttl=5.0).connect()
    try:  # int(b"abc") was a ValueError: the agent's sweeper task died of it
        with pytest.raises(InvalidResponse, match="dead set"):
            await d.sweep()
    finally:
        await d.aclose()


@pytest.mark.parametrize("member", [b"99999999999", b"-1", b"4294967296"])
async def test_a_dead_set_number_past_uint32_is_an_invalid_response(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], member: bytes
) -> None:
    """A dead set member that is an int but no node number: packed as a uint32 for the sweep
    script, it raised OverflowError out of the sweeper. Now InvalidResponse."""
    from tierkv.remote.membership.redis_directory import RedisDirectory

    start, _ = fake
    answer = b"*1\r\n$%d\r\n%s\r\n" % (len(member), member)
    at = await start(redis_like({**STANDALONE, b"SRANDMEMBER": answer}))
    d = await RedisDirectory(f"redis://127.0.0.1:{at.port}/0", ttl=5.0).connect()
    try:
        with pytest.raises(InvalidResponse, match="dead set"):
            await d.sweep()
    finally:
        await d.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b":5\r\n",  # not a pair: a TypeError unpacking it
        b"*2\r\n$3\r\nabc\r\n:0\r\n",  # bytes < 0: a TypeError
        b"*2\r\n:4294967296\r\n:0\r\n",  # a number no uint32 holds: OverflowError at publish
        b"*3\r\n:1\r\n:0\r\n:0\r\n",
    ],
    ids=["int", "bytes", "huge", "triple"],
)
async def test_a_hostile_register_reply_is_an_invalid_response(
    fake: tuple[Callable[[Handler], Awaitable[Where]], list[str]], answer: bytes
) -> None:
    from tierkv.remote.membership.redis_directory import RedisDirectory

    start, _ = fake
    at = await start(redis_like({**STANDALONE, b"EVALSHA": answer}))
    d = await RedisDirectory(f"redis://127.0.0.1:{at.port}/0", ttl=5.0, timeout=5.0).connect()
    try:
        with pytest.raises(InvalidResponse, match="register"):
            await d.register("a:1")
    finally:
        await d.aclose()


def test_hostile_counts_are_invalid_responses() -> None:
    from tierkv.remote.membership.replies import counted, registered

    assert counted([1, 0, b"2"], "x") == 3
    assert registered([3, 0]) == (3, 0) and registered([-1, 500]) == (-1, 500)
    for bad in ([-1], [b"abc"], [None], [[1]]):
        with pytest.raises(InvalidResponse):
            counted(bad, "x")
