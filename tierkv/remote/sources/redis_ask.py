"""Reads of keys in a half-moved Redis Cluster slot, redirection by redirection.

While a slot migrates, a key not yet copied stays on the source node and one already moved
answers ``-ASK slot host:port``: the client must send ``ASKING`` and then the command **on the
same connection** of the importing node. redis-py 8.1's asyncio cluster client may send the two
on different pooled connections, so the importing node answers MOVED, the client bounces until
"TTL exhausted", and the read fails. `AskFollower` retries such reads itself: a GET at the
slot's owner, then on ``-ASK`` an ``ASKING`` + GET pipeline on one connection of the named node
(on ``-MOVED``, a GET there). Used by `RedisTier` in cluster mode for the reads a pipeline
returned as errors; everything it does is bounded by the caller's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, MovedError

from tierkv.remote.membership.bounded import bounded

__all__ = ["AskFollower"]


class AskFollower:
    """One plain client per node address, made on first use (keyword ``options`` for each),
    its replies bounded by ``bounds`` (`tierkv.remote.membership.bounded.bounded`'s)."""

    def __init__(self, bounds: dict[str, int], **options: Any) -> None:
        self._bounds = bounds  # what a node's reply may make us allocate (`bounded`)
        self._options = options
        self._clients: dict[tuple[str, int], Redis] = {}

    def _node(self, host: str, port: int) -> Redis:
        client = self._clients.get((host, port))
        if client is None:
            client = bounded(Redis(host=host, port=port, **self._options), **self._bounds)
            self._clients[(host, port)] = client
        return client

    async def get(self, cluster: RedisCluster, rkey: bytes, px: int | None) -> Any:
        """The value of ``rkey`` (None when absent), following one ASK or MOVED redirection.
        Raises what the nodes raise (the caller counts it as a miss)."""
        owner = cluster.get_node_from_key(rkey.decode())  # keys are ascii (see redis_key)
        if owner is None:
            return None  # no node serves the slot now: a miss
        try:
            return await self._read(self._node(owner.host, int(owner.port)), rkey, px)
        except MovedError as moved:  # checked first: MovedError is an AskError
            return await self._read(self._node(moved.host, int(moved.port)), rkey, px)
        except AskError as ask:
            pipe = self._node(ask.host, int(ask.port)).pipeline(transaction=False)
            pipe.execute_command("ASKING")
            if px is None:
                pipe.get(rkey)
            else:
                pipe.getex(rkey, px=px)
            _, value = await pipe.execute()  # one connection: ASKING applies to the GET
            return value

    @staticmethod
    async def _read(node: Redis, rkey: bytes, px: int | None) -> Any:
        return await (node.get(rkey) if px is None else node.getex(rkey, px=px))

    async def aclose(self) -> None:
        """Close every node client (errors ignored)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()

    def __len__(self) -> int:
        return len(self._clients)


async def follow_failed(
    follower: AskFollower,
    cluster: RedisCluster,
    rkeys: list[bytes],
    values: list[Any],
    px: int | None,
) -> None:
    """Replace each exception in ``values`` (the reply of ``rkeys``) by the value read through
    `follower`, where that works; the rest stay exceptions."""
    failed = [i for i, v in enumerate(values) if isinstance(v, Exception)]
    if not failed:
        return
    got = await asyncio.gather(
        *(follower.get(cluster, rkeys[i], px) for i in failed), return_exceptions=True
    )
    for i, value in zip(failed, got):
        # an error stays one (a miss); a cancelled read (a BaseException) is a miss too
        cancelled = isinstance(value, BaseException) and not isinstance(value, Exception)
        values[i] = None if cancelled else value
