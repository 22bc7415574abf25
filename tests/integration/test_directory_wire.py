"""The directory's own connections for locate on a standalone server (membership/wire.py):
the URL forms they follow (password, username, db, unix socket) or leave to the scripts (TLS),
error replies, a server that closes or never answers, a trip cancelled halfway."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent))
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, RedisError, ResponseError
from redis_server import RedisServer, skip_without_redis

from tierkv.remote.membership.layout import resp
from tierkv.remote.membership.redis_directory import RedisDirectory
from tierkv.remote.membership.wire import Links, Where, where

skip_without_redis()


def keys_of(n: int, seed: int = 0) -> list[bytes]:
    rnd = __import__("random").Random(seed)
    return [bytes([rnd.randrange(128)]) + rnd.randbytes(15) for _ in range(n)]


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("redis://127.0.0.1:6390/0", Where(host="127.0.0.1", port=6390)),
        ("redis://u:pw@h:1/3", Where(host="h", port=1, username="u", password="pw", db=3)),
        ("redis://:pw@h:1", Where(host="h", port=1, password="pw")),
        ("unix:///tmp/r.sock?db=2&password=pw", Where(path="/tmp/r.sock", password="pw", db=2)),
        ("rediss://:pw@h:2/0", None),  # TLS: the scripts through redis-py
    ],
)
def test_where_follows_the_url_or_leaves_it_to_redis_py(url: str, want: Where | None) -> None:
    assert where(Redis.from_url(url)) == want


async def _served(d: RedisDirectory, n: int = 300) -> list[bytes]:
    keys = keys_of(n, seed=n)
    a, b = await d.register("a:1"), await d.register("b:2")
    await d.publish(a, keys)
    await d.publish(b, keys[::3])
    return keys


def _want(keys: list[bytes]) -> list[tuple[str, ...]]:
    return [("a:1", "b:2") if i % 3 == 0 else ("a:1",) for i in range(len(keys))]


async def test_locate_through_a_password_a_db_and_a_unix_socket(tmp_path: Path) -> None:
    """AUTH (with and without a username) and SELECT are sent when our connections open: the
    answers come from the db the client uses, and the HGETs arrive on that db."""
    sock = tmp_path / "r.sock"
    with RedisServer(args=["--unixsocket", str(sock), "--unixsocketperm", "700"]) as srv:
        first = await Redis.from_url(srv.url)
        await first.config_set("requirepass", "pw")  # (the server's start is a PING: no auth)
        await first.aclose()
        base = f"redis://:pw@127.0.0.1:{srv.port}"
        for url in (
            f"{base}/3",
            f"redis://default:pw@127.0.0.1:{srv.port}/4",
            f"unix://{sock}?db=5&password=pw",
        ):
            d = await RedisDirectory(url, ttl=5.0).connect()
            try:
                keys = await _served(d)
                assert await d.locate(keys + keys_of(5, seed=99)) == _want(keys) + [()] * 5
                clients = await d.client.client_list()
                assert any(c["cmd"] == "hget" for c in clients), clients
                numbers, live = await d.holders(keys[:2])
                assert [tuple(live[n] for n in ns) for ns in numbers] == _want(keys)[:2]
            finally:
                await d.aclose()
        other = await RedisDirectory(f"{base}/3").connect()  # db 3 holds what the first wrote
        try:
            assert await other.client.dbsize() > 0 and (await other.live())
        finally:
            await other.aclose()


async def test_an_error_reply_and_a_killed_connection_are_raised_then_ridden_out() -> None:
    """A key whose bucket is not a hash (another writer's): its WRONGTYPE reply is no holders,
    counted (it was raised: the locate of every key beside it failed while it was there), the
    other keys answered; our connections killed by the server: the locate in flight raises,
    the next reconnects."""
    with RedisServer() as srv:
        d = await RedisDirectory(srv.url, ttl=5.0).connect()
        try:
            keys = await _served(d)
            bad = keys_of(1, seed=7)[0]
            await d.client.set(d.layout.bucket_of(bad), b"not a hash")
            assert await d.locate([*keys[:10], bad]) == [*_want(keys[:10]), ()]
            assert d.refused_entries == 1
            assert await d.locate(keys) == _want(keys)  # the connection stayed in step
            await d.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            try:
                got = await d.locate(keys)
            except (RedisError, OSError):
                got = await d.locate(keys)
            assert got == _want(keys)
        finally:
            await d.aclose()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Handler], Awaitable[Where]]]:
    """A TCP server answering as the handler says (not Redis)."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Where:
        srv = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(srv)
        return Where(host="127.0.0.1", port=srv.sockets[0].getsockname()[1])

    yield start
    for srv in servers:
        srv.close()


async def test_a_silent_server_times_out_and_a_cancelled_trip_closes_its_connection(
    fake: Callable[[Handler], Awaitable[Where]],
) -> None:
    """Every trip ends by its deadline; a connection whose trip timed out or was cancelled
    is closed (the server sees it end), never reused."""
    ended: list[int] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass
        ended.append(1)
        writer.close()

    links = Links(await fake(silent), timeout=0.2)
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(TimeoutError):
        await links.trip(resp("PING"), 1)
    assert loop.time() - t < 2.0
    trip = asyncio.ensure_future(Links(links.to, timeout=30).trip(resp("PING"), 1))
    await asyncio.sleep(0.05)
    trip.cancel()
    with pytest.raises(asyncio.CancelledError):
        await trip
    for _ in range(100):
        if len(ended) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(ended) == 2


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"", RedisConnectionError),  # closed before answering
        (b"$3\r\nab", RedisConnectionError),  # closed halfway through a reply
        (b"+OK\r\n+OK\r\n", InvalidResponse),  # more replies than commands
        (b"?what\r\n", InvalidResponse),  # not RESP
    ],
)
async def test_a_bad_or_broken_answer_is_a_redis_error(
    fake: Callable[[Handler], Awaitable[Where]], answer: bytes, error: type[Exception]
) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(answer)
        await writer.drain()
        writer.close()

    links = Links(await fake(once), timeout=2.0)
    with pytest.raises(error):
        await links.trip(resp("PING"), 1)
    await links.aclose()


async def test_auth_refused_by_our_connection_is_raised(
    fake: Callable[[Handler], Awaitable[Where]],
) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"-WRONGPASS invalid username-password pair\r\n+OK\r\n")
        await writer.drain()

    to = await fake(refuse)
    links = Links(Where(host=to.host, port=to.port, password="no", db=2), timeout=2.0)
    with pytest.raises(ResponseError, match="WRONGPASS"):
        await links.trip(resp("PING"), 1)
