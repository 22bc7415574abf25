"""A hostile server behind a Redis page tier's URL (tierkv/remote/membership/bounded.py): a reply
announcing a huge aggregate or bulk is refused before redis-py's parser allocates it, and ends
as a counted error (a miss) within the call's bound, never a MemoryError or a timeout spent
receiving; the directory's redis-py client (a Cluster's, a TLS URL's) is bounded the same way.
Also the guard's own framing: headers split anywhere, payloads skipped, never buffered."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

pytest.importorskip("redis")
pytest.importorskip("hiredis")
pytest.importorskip("xxhash")
from redis.asyncio import Redis
from redis.exceptions import InvalidResponse

from tierkv.remote import RedisTier
from tierkv.remote.membership.bounded import bounded
from tierkv.remote.membership.replies import MAX_ELEMENTS, AggregateGuard
from tierkv.remote.sources.redis_tier import HEADER_BYTES
from tierkv.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PB = SPEC.page_bytes
LOG = "tierkv.remote.redis"


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[bytes, bytes], Awaitable[str]]]:
    """A TCP server answering every request with ``answer``, then ``then`` for as long as
    the client reads (b"": nothing more); returns its URL."""
    servers: list[asyncio.Server] = []

    async def start(answer: bytes, then: bytes = b"") -> str:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while await reader.read(1 << 16):
                    writer.write(answer)
                    await writer.drain()
                    while then:
                        writer.write(then)
                        await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        srv = await asyncio.start_server(run, "127.0.0.1", 0)
        servers.append(srv)
        return f"redis://127.0.0.1:{srv.sockets[0].getsockname()[1]}/0"

    yield start
    for srv in servers:
        srv.close()


HUGE = [
    b"*4294967295\r\n",  # hiredis asked 32 GiB for it: a MemoryError
    b"*2147483647\r\n" * 7,  # nested, 16 GiB a level
    b"*2\r\n$4\r\nPONG\r\n*5000000\r\n",  # the second element
    b"%2000000\r\n",
    b"~2000000\r\n",
    b">2000000\r\n",
    b"$4\r\n*9999999\r\n*2000000\r\n",  # a payload that looks like one, then a real one
]


@pytest.mark.parametrize("answer", HUGE, ids=range(len(HUGE)))
async def test_a_huge_aggregate_is_a_counted_miss_not_an_allocation(
    hostile: Callable[[bytes, bytes], Awaitable[str]],
    answer: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fails on the old code: the count went to hiredis (a MemoryError, counted)."""
    url = await hostile(answer, b"")
    caplog.set_level(logging.WARNING, LOG)
    async with RedisTier(url, spec=SPEC, timeout=5.0) as rt:
        assert not rt.available
        st = rt.stats()
        assert st["errors"] == 1 and st["timeouts"] == 0, st
        assert "InvalidResponse" in caplog.text and "aggregate" in caplog.text, caplog.text
        assert "MemoryError" not in caplog.text


async def test_a_large_aggregate_allocates_nothing(
    hostile: Callable[[bytes, bytes], Awaitable[str]],
) -> None:
    """``*50000000`` (a 400 MB list in hiredis on the old code, which it could allocate):
    refused with a few KiB traced."""
    url = await hostile(b"*50000000\r\n", b"")
    tracemalloc.start()
    try:
        async with RedisTier(url, spec=SPEC, timeout=5.0) as rt:
            assert rt.stats()["errors"] == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


async def test_a_huge_bulk_is_refused_at_its_header_not_received(
    hostile: Callable[[bytes, bytes], Awaitable[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """A value of a TiB, sent without end: refused at its length (an error, not the call's
    timeout spent buffering it). Fails on the old code (a timeout after buffering)."""
    url = await hostile(b"$1099511627776\r\n", b"x" * (1 << 16))
    caplog.set_level(logging.WARNING, LOG)
    async with RedisTier(url, spec=SPEC, timeout=3.0) as rt:
        st = rt.stats()
        assert st["errors"] == 1 and st["timeouts"] == 0, st
        assert "bulk reply of 1099511627776 bytes" in caplog.text, caplog.text


async def test_a_reply_past_its_bytes_is_cut_off(
    hostile: Callable[[bytes, bytes], Awaitable[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """An aggregate of legal size whose elements never end: cut off at the reply's bytes."""
    elem = b"$65536\r\n" + b"z" * 65536 + b"\r\n"
    url = await hostile(b"*999999\r\n", elem)
    caplog.set_level(logging.WARNING, LOG)
    async with RedisTier(url, spec=SPEC, timeout=30.0, batch_pages=4) as rt:
        st = rt.stats()
        assert st["errors"] == 1 and st["timeouts"] == 0, st
        assert "a reply of over" in caplog.text, caplog.text


async def test_a_load_of_a_hostile_value_length_is_a_miss(
    hostile: Callable[[bytes, bytes], Awaitable[str]],
) -> None:
    """Past the PING (answered by a real-looking PONG), an MGET answered with a value longer
    than any page's is a miss, its rows untouched."""
    head = b"+PONG\r\n"  # PING, then CONFIG GET (an error reply: unknown), then MGET
    url = await hostile(head + b"-ERR no\r\n" + b"*1\r\n$99999999\r\n", b"")
    async with RedisTier(url, spec=SPEC, timeout=3.0) as rt:
        rows = np.zeros((2, PB), np.uint8)
        assert await rt.load([b"k" * 18], rows, [0]) == 0
        assert not rows.any()


def test_the_guard_walks_split_headers_and_skips_payloads() -> None:
    value = HEADER_BYTES + PB
    stream = (
        b"*3\r\n"
        + (b"$%d\r\n" % value + b"*9999999\r\n".ljust(value, b"x") + b"\r\n") * 2
        + b"$-1\r\n+OK\r\n:5\r\n-ERR *99999999\r\n"
    )
    for step in (1, 2, 3, 7, 64, len(stream)):
        guard = AggregateGuard(max_bulk=value)
        for at in range(0, len(stream), step):
            guard.feed(stream[at : at + step])
    for bad, why in [
        (b"$%d\r\n" % (value + 1), "bulk"),
        (b"*%d\r\n" % (MAX_ELEMENTS + 1), "aggregate"),
        (b"$12a\r\n", "not RESP"),
        (b"*" + b"1" * 40, "length line"),
    ]:
        for step in (1, 3, len(bad)):
            guard = AggregateGuard(max_bulk=value)
            with pytest.raises(InvalidResponse, match=why):
                for at in range(0, len(bad), step):
                    guard.feed(bad[at : at + step])


async def test_the_directory_and_ask_clients_are_bounded_too(
    hostile: Callable[[bytes, bytes], Awaitable[str]],
) -> None:
    """The directory's redis-py client (a Cluster's or a TLS URL's replies are redis-py's) and
    a plain client under `bounded`: the same refusal."""
    from tierkv.remote.membership.redis_directory import RedisDirectory

    url = await hostile(b"*4294967295\r\n", b"")
    d = RedisDirectory(url, timeout=3.0)
    with pytest.raises(InvalidResponse, match="aggregate"):
        await d.client.ping()
    await d.client.aclose()
    client = bounded(Redis.from_url(url, socket_timeout=3.0), max_bulk=1024, max_reply=1 << 20)
    with pytest.raises(InvalidResponse, match="aggregate"):
        await client.ping()
    await client.aclose()
