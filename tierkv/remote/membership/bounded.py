"""Bounds on what a Redis server's replies can make a redis-py client allocate: the directory's
(`replies.AggregateGuard`, as on its own connections in `wire`) put under redis-py's hiredis
parser, for every reader of Redis replies that goes through redis-py (the Redis page tier, its
ASK follower, the directory on a Cluster or a TLS URL).

hiredis allocates an aggregate's announced count at once (``*4294967295`` alone asked 32
GiB: a MemoryError, and a smaller count the memory itself), and buffers a bulk's announced
length as it comes. `bounded` connections walk every byte read, before hiredis sees it, and
raise ``redis.exceptions.InvalidResponse`` (a RedisError: the callers count it, drop the
connection and ride it out) at an aggregate over ``replies.MAX_ELEMENTS``, a bulk over
``max_bulk`` bytes, or a reply over ``max_reply`` bytes::

    client = bounded(Redis.from_url(url), max_bulk=1 << 20, max_reply=64 << 20)
"""

from __future__ import annotations

from typing import Any, TypeVar

import hiredis  # noqa: F401 - the parser below is hiredis's (the redis extra installs it)
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import DefaultParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

from tierkv.remote.membership.replies import AggregateGuard

__all__ = ["BoundedParser", "bounded", "parser_for"]

_C = TypeVar("_C", bound=Redis | RedisCluster)


class BoundedParser(DefaultParser):  # type: ignore[misc,valid-type]
    """redis-py's hiredis parser (its default one with hiredis installed), every byte read
    walked by an `AggregateGuard` first, and the bytes read for one reply counted (subclasses
    set the bounds: `parser_for`)."""

    max_bulk: int | None = None
    """The longest bulk string a reply may hold (None: any)."""
    max_reply: int = 1 << 62
    """The most bytes read while waiting for one reply."""

    def on_connect(self, connection: Any) -> None:
        """A fresh connection: a fresh parser and guard (the stream starts here)."""
        super().on_connect(connection)
        self._guard = AggregateGuard(self.max_bulk)
        self._read = 0

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """One reply, as hiredis parses it (InvalidResponse past a bound)."""
        self._read = 0
        return await super().read_response(*args, **kwargs)

    async def read_from_socket(self) -> bool:
        """The next bytes, walked by the guard before hiredis is fed them."""
        assert self._stream is not None and self._reader is not None  # (set at on_connect)
        data = await self._stream.read(self._read_size)
        if not data or not isinstance(data, bytes):
            raise RedisConnectionError("Connection closed by server.")
        self._read += len(data)
        if self._read > self.max_reply:
            raise InvalidResponse(f"a reply of over {self.max_reply} bytes")
        self._guard.feed(data)  # raises before hiredis allocates
        self._reader.feed(data)
        return True


def parser_for(max_bulk: int | None, max_reply: int) -> type[BoundedParser]:
    """A `BoundedParser` class with these bounds (redis-py makes one parser per
    connection from the class)."""
    return type("BoundedParser", (BoundedParser,), {"max_bulk": max_bulk, "max_reply": max_reply})


def bounded(client: _C, *, max_bulk: int | None, max_reply: int) -> _C:
    """``client`` (not connected yet), whose connections parse with the bounds: a standalone
    client's pool and a Cluster client's nodes, those it knows and those it learns of."""
    parser = parser_for(max_bulk, max_reply)
    if isinstance(client, RedisCluster):
        # one dict shared with the nodes manager (the nodes it learns of); the startup
        # nodes were made with copies of it
        client.connection_kwargs["parser_class"] = parser
        for node in client.startup_nodes:
            node.connection_kwargs["parser_class"] = parser
    else:
        client.connection_pool.connection_kwargs["parser_class"] = parser
    return client
