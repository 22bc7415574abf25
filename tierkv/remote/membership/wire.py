"""`Links`: connections of the directory's own to a standalone Redis / Valkey, for `locate`:
one write of a pipeline of plain commands (the live set, then one HGET per key), every reply
parsed by hiredis into one list by a C loop.

Why not redis-py's pipeline: it reads each reply through Python calls and a timeout context
(about 10 us a reply: 10 ms for 1,000 HGETs), so a locate went through one Lua script instead,
whose ``redis.call`` and string cutting cost the server 0.6 us a key more than the same HGETs
sent as commands (1,000 keys: 1.65 -> 1.05 ms of server CPU, measured). The connections here
are made from what redis-py parsed of the URL (host and port or a unix socket path, username,
password, db: ``AUTH`` and ``SELECT`` at connect); a URL that needs more (TLS, a credential
provider, a Cluster) gets no `Links` (`where` answers None) and locates by scripts.

::

    links = Links(where(client), timeout=1.0)
    replies = await links.trip(request, n)       # n replies, in order (errors as objects)
    await links.aclose()

Every trip is bounded by ``timeout`` (connect included) and its replies' bytes by
`reply_bytes`; an aggregate reply announcing more than ``replies.MAX_ELEMENTS`` elements is
refused before hiredis allocates them (a hostile server's ``*4294967295`` asked 32 GiB). A
connection that failed, timed out, was cut off or cancelled mid-trip is closed (what it would
read next is unknown), never reused.
Errors: OSError (refused, reset), ``redis.exceptions.ConnectionError`` (closed by the server),
``ResponseError`` (AUTH / SELECT refused), ``InvalidResponse`` (not RESP), TimeoutError.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

from tierkv.remote.membership.layout import resp
from tierkv.remote.membership.replies import AggregateGuard, suspect

if sys.version_info >= (3, 11):
    _deadline: Callable[[float], Any] = asyncio.timeout
else:  # pragma: no cover - redis-py requires async-timeout before 3.11
    from async_timeout import timeout as _deadline

__all__ = [
    "KEEP",
    "REPLY_BYTES",
    "TRIP_BYTES",
    "Links",
    "Scripts",
    "Where",
    "command",
    "reply_bytes",
    "scripted",
    "where",
]

KEEP = 4
"""Idle connections kept for the next locates (more are opened while more run at once)."""

TRIP_BYTES = 4 << 20
REPLY_BYTES = 4 << 10
"""A trip's replies may take ``TRIP_BYTES`` and ``REPLY_BYTES`` per command in all (the live
set and entries of ~1,000 holders each); a server that sends more is cut off."""


def reply_bytes(n: int) -> int:
    """The most bytes the replies to ``n`` commands may take."""
    return TRIP_BYTES + n * REPLY_BYTES


@dataclass(frozen=True)
class Where:
    """Where and how to connect: a TCP address or a unix socket path, then AUTH and SELECT."""

    host: str = ""
    port: int = 0
    path: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0


def where(client: Redis | Any) -> Where | None:
    """What redis-py parsed of a standalone client's URL, or None when our connections could
    not reproduce it (TLS, a credential provider, another connection class, a Cluster)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    kind, kw = pool.connection_class, pool.connection_kwargs
    if kind not in (Connection, UnixDomainSocketConnection) or kw.get("credential_provider"):
        return None
    return Where(
        host=kw.get("host", "") if kind is Connection else "",
        port=int(kw.get("port", 6379)) if kind is Connection else 0,
        path=kw.get("path", "") if kind is UnixDomainSocketConnection else "",
        username=kw.get("username"),
        password=kw.get("password"),
        db=int(kw.get("db") or 0),
    )


_MORE = object()
"""What the parser's ``gets`` answers when no reply is complete (its default, False, equals
an integer reply of 0: a trip of ``:0`` replies waited for more until its deadline)."""


class _Link:
    """One connection: a request written whole, its replies read until all have come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = hiredis.Reader(
            protocolError=InvalidResponse, replyError=ResponseError, notEnoughData=_MORE
        )

    async def trip(self, request: bytes | bytearray, n: int) -> list[Any]:
        self.writer.write(request)
        await self.writer.drain()
        out: list[Any] = []
        limit, got, tail = reply_bytes(n), 0, b""
        seen: list[bytes] = []  # the trip's bytes, walked by a guard if one is needed
        guard: AggregateGuard | None = None
        while len(out) < n:
            data = await self.reader.read(1 << 20)
            if not data:
                raise RedisConnectionError("the directory's server closed the connection")
            got += len(data)
            if got > limit:
                raise InvalidResponse(f"more than {limit} bytes of replies to {n} commands")
            if guard is None:
                seen.append(data)
                if suspect(tail + data[:8]) or suspect(data):
                    guard = AggregateGuard()
                    for chunk in seen:
                        guard.feed(chunk)  # InvalidResponse before hiredis allocates
                tail = data[-8:]
            else:
                guard.feed(data)
            self.parser.feed(data)
            out += iter(self.parser.gets, _MORE)  # every complete reply: a C loop
        if len(out) > n:
            raise InvalidResponse(f"{len(out)} replies to {n} commands")
        return out

    def close(self) -> None:
        self.writer.transport.abort()  # at once: nothing it holds is wanted any more


class Links:
    """Connections to one standalone server, opened when needed, ``KEEP`` kept idle."""

    def __init__(self, to: Where, timeout: float) -> None:
        self.to, self.timeout = to, timeout
        self._idle: list[_Link] = []

    async def _open(self) -> _Link:
        to = self.to
        if to.path:
            reader, writer = await asyncio.open_unix_connection(to.path)
        else:
            reader, writer = await asyncio.open_connection(to.host, to.port)
        link = _Link(reader, writer)
        try:
            hello = []
            if to.password is not None:
                who = (to.username,) if to.username else ()
                hello.append(resp("AUTH", *who, to.password))
            if to.db:
                hello.append(resp("SELECT", to.db))
            if hello:
                for reply in await link.trip(b"".join(hello), len(hello)):
                    if isinstance(reply, Exception):
                        raise reply
        except BaseException:
            link.close()
            raise
        return link

    async def trip(self, request: bytes | bytearray, n: int) -> list[Any]:
        """Write ``request`` (``n`` commands) and return its ``n`` replies (an error reply
        is a ResponseError in its place). Bounded by ``timeout``, connecting included."""
        link = None
        try:
            async with _deadline(self.timeout):
                link = self._idle.pop() if self._idle else await self._open()
                replies = await link.trip(request, n)
        except BaseException:
            if link is not None:
                link.close()  # its stream is somewhere unknown: never reused
            raise
        if len(self._idle) < KEEP:
            self._idle.append(link)
        else:
            link.close()
        return replies

    async def aclose(self) -> None:
        """Close the idle connections (one in a trip is closed when its trip ends)."""
        idle, self._idle = self._idle, []
        for link in idle:
            link.close()
        await asyncio.sleep(0)  # their transports' connection_lost runs


def _raised(replies: list[Any]) -> list[Any]:
    """``replies``, or the first error reply among them raised (as a pipeline does)."""
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return replies


async def command(links: Links, *args: bytes | str | int) -> Any:
    """One command on our own connections (bounded as a locate's trip); its reply as hiredis
    parsed it (bytes, ints, lists), an error reply raised."""
    return _raised(await links.trip(resp(*args), 1))[0]


class Scripts:
    """A redis-py pipeline's stand-in for `scripted`: the ``evalsha`` calls added, in RESP."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def evalsha(self, *args: bytes | str | int) -> None:
        """Add ``EVALSHA args...``."""
        self.parts.append(resp("EVALSHA", *args))


async def scripted(
    links: Links, build: Callable[[Scripts], Any], scripts: Sequence[str]
) -> list[Any]:
    """The scripts ``build`` adds, in one trip on our own connections (so a hostile server's
    replies to the agent's calls are as bounded as a locate's); ``scripts`` loaded again when
    the server answers NOSCRIPT (restarted); the first error reply raised."""
    calls = Scripts()
    build(calls)
    request, n = b"".join(calls.parts), len(calls.parts)
    replies = await links.trip(request, n)
    if any(isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT") for r in replies):
        _raised(
            await links.trip(b"".join(resp("SCRIPT", "LOAD", x) for x in scripts), len(scripts))
        )
        replies = await links.trip(request, n)
    return _raised(replies)
