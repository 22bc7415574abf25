"""`RedisDirectory`: the cluster's page directory in Redis / Valkey (layout.py draws the keys,
holds the Lua and the request encoding). This file stays whole (~400 lines): one class whose
calls share the client (standalone or Cluster), the layout read from Redis and the script
loading.

::

    d = await RedisDirectory("redis://:pw@10.0.0.5:6379/0", ttl=5.0).connect()
    n = await d.register("10.0.0.7:7600")        # a node: a fresh number, live for ttl
    await d.refresh(n, "10.0.0.7:7600")          # every ttl/3 (False: lapsed, register again)
    await d.publish(n, add=keys, drop=gone)      # one round trip per call (batches pipelined)
    holders = await d.locate(keys)               # per key the live nodes holding it
                                                 #   one round trip per 1,000 keys
    await d.sweep()                              # entries of dead nodes removed

Only live nodes are answered: an entry names a node *number*, and a number is live while its
expiry (the server's clock) is ahead; a node that registers again (a restart, or after losing
Redis) gets a new number, so what it held before is never answered under its new one. Dead
numbers' entries are removed by `sweep` (any node may run it; a lock key keeps it to one).

A standalone server keeps the buckets in one shard and is asked by plain commands on
connections of our own (wire.py: the live set and one HGET per key in one write, the replies
parsed in C; 0.6 us of server time a key less than a script's ``redis.call``), and so are all
the other calls there (their replies bounded against a hostile server, as a locate's); on a Redis
Cluster (detected at `connect`), or a URL those connections do not follow (TLS), the buckets
spread over ``shards`` hash-tagged shards and a locate is one pipeline of one LOCATE script
per shard touched, sent to the shards' nodes in parallel.

Errors: `connect` raises DirectoryURLError (a URL or option that does not parse),
DirectoryAuthError (credentials refused), DirectoryError (unreachable); `register` raises
NodeIdTakenError. The other calls raise redis-py's errors (RedisError, OSError, TimeoutError)
for the caller (`DirectoryAgent`, `RemoteCluster`) to count and ride out.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    InvalidResponse,
    NoScriptError,
    RedisError,
    ResponseError,
)

from tierkv.remote.errors import (
    DirectoryAuthError,
    DirectoryError,
    DirectoryURLError,
    NodeIdTakenError,
)
from tierkv.remote.membership.bounded import bounded
from tierkv.remote.membership.layout import (
    LEAVE,
    LIVE,
    LOCATE,
    PUBLISH,
    REFRESH,
    REGISTER,
    SWEEP,
    Layout,
    blob,
    check_keys,
    fixed_length,
    pack,
    resp,
)
from tierkv.remote.membership.replies import (
    MAX_ADDRESS,
    check_address,
    counted,
    entry_refused,
    live_set,
    node_numbers,
    registered,
    script_reply,
)
from tierkv.remote.membership.wire import Links, command, reply_bytes, scripted, where

__all__ = ["BUCKETS", "CLUSTER_SHARDS", "LOCATE_BATCH", "MAX_ADDRESS", "RedisDirectory"]

BUCKETS = 1 << 16
"""Buckets by default: about 15 keys each at 10^6 keys (listpack up to 128; docs/remote.md)."""
CLUSTER_SHARDS = 16
"""Shards (hash tags) on a Redis Cluster by default; a standalone server uses one."""
LOCATE_BATCH = 1000
"""Keys per locate script: a locate of 1,000 keys is one round trip."""
PUBLISH_BATCH = 4096
"""Keys per publish script (a script blocks the server while it runs: a few ms each)."""
SWEEP_BUCKETS = 64
"""Buckets per sweep script (about 1,000 entries at 10^6 keys: a millisecond or so)."""
SWEEP_PIPELINE = 1
"""Sweep scripts per round trip (a client's pipeline runs back to back on the server, so one
at a time: other clients are served between them)."""

_SCRIPTS = (REGISTER, REFRESH, LEAVE, LIVE, LOCATE, PUBLISH, SWEEP)
_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in _SCRIPTS}
_NAMESPACE = re.compile(r"[A-Za-z0-9._/@+=:-]{1,64}")
Client = Redis | RedisCluster


_Reply = tuple[list[int] | None, bytes, bytes]
"""A locate script's keys' places (None: the keys in order), holder counts, holders."""
T = TypeVar("T")


def _answers(n: int, replies: list[_Reply], name: Callable[[int], T | None]) -> list[tuple[T, ...]]:
    """Per key the names of its live holders (``name``: None for a number not live) from the
    replies of LOCATE: the counts (uint16 LE) and holders (uint32 LE) unpacked by one C call
    each, one Python step per key (the common case, one holder each: one tuple per key)."""
    out: list[tuple[T, ...]] = [] if all(r[0] is None for r in replies) else [()] * n
    for order, counts, held in replies:
        k = len(counts) // 2
        per_key: Iterable[tuple[T, ...]]
        if counts == b"\x01\x00" * k:
            per_key = [(a,) if a is not None else () for a in map(name, _u32(held))]
        else:
            per_key = _split(struct.unpack(f"<{k}H", counts), _u32(held), name)
        if order is None:
            out += per_key
        else:
            for at, one in zip(order, per_key):
                out[at] = one
    return out


_ODD = object()


def _by_value(values: list[Any], names: Mapping[int, T]) -> tuple[list[tuple[T, ...]], int]:
    """Per key the names of its live holders from its HGET reply (uint32 LE numbers end to
    end; None: no entry), and how many entries tierkv never writes were left out as no
    holders (`entry_refused`): one C map through a table of the live numbers' 4-byte values to
    one shared tuple each (a key held by one live node, the common case), a Python step only
    for the other keys (several holders, or a number not live)."""
    one: dict[Any, tuple[T, ...]] = {n.to_bytes(4, "little"): (a,) for n, a in names.items()}
    one[None] = ()
    try:
        got: list[Any] = list(map(one.get, values, repeat(_ODD)))
    except TypeError:  # an unhashable reply (an array): not an entry, raised below
        got = [_ODD] * len(values)
    refused = 0
    if got.count(_ODD):
        for i, v in enumerate(values):
            if got[i] is _ODD:
                if entry_refused(v):
                    refused += 1
                    got[i] = ()
                else:
                    got[i] = tuple(a for h in _u32(v) if (a := names.get(h)) is not None)
    return got, refused


def _u32(held: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(held) // 4}I", held)


def _split(
    counts: Sequence[int], numbers: Sequence[int], name: Callable[[int], T | None]
) -> Iterator[tuple[T, ...]]:
    at = 0
    for c in counts:
        yield tuple(a for h in numbers[at : at + c] if (a := name(h)) is not None)
        at += c


def check_url(url: str) -> None:
    """Raise DirectoryURLError unless redis-py takes ``url`` (``redis://``, ``rediss://``,
    ``unix://``; a password or not). Connects to nothing."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise DirectoryURLError(f"a directory URL is redis://, rediss:// or unix://, not {url!r}")
    try:
        parts = urlsplit(url)
        Redis.from_url(url)
        _ = parts.port  # ValueError for a port out of range
    except (ValueError, TypeError, RedisError) as exc:
        raise DirectoryURLError(f"bad directory url {url!r}: {exc}") from exc
    db = parts.path.strip("/")
    if parts.scheme != "unix" and (not parts.hostname or (db and not db.isdigit())):
        raise DirectoryURLError(f"bad directory url {url!r}: host:port/db, db a number")


class RedisDirectory:
    """The page directory of a cluster, in one Redis / Valkey (standalone or Cluster).

    Args:
        url: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS): what redis-py's
            ``from_url`` takes.
        namespace: prefix of every key (clusters sharing one Redis use different ones).
        ttl: seconds a node stays live without a refresh (a killed node leaves every answer
            within it).
        timeout: bound of each call to Redis (connect, socket reads).
        buckets / shards: the layout, set by the first node to register (later ones and
            locators read it from Redis). shards: None is 1 standalone, CLUSTER_SHARDS on a
            Cluster.
        client_options: extra keyword arguments for ``from_url`` (``ssl_ca_certs``, ...).

    Raises DirectoryURLError for a bad namespace, ttl, timeout, layout or url.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "tkv:dir",
        ttl: float = 5.0,
        timeout: float = 1.0,
        buckets: int = BUCKETS,
        shards: int | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise DirectoryURLError(f"namespace must match {_NAMESPACE.pattern}, not {namespace!r}")
        for name, x, kinds in (
            ("ttl", ttl, (int, float)),
            ("timeout", timeout, (int, float)),
            ("buckets", buckets, (int,)),
            ("shards", 1 if shards is None else shards, (int,)),
        ):  # (a str or None was a TypeError of the range checks below, a float bucket count
            # an AttributeError)
            if isinstance(x, bool) or not isinstance(x, kinds):
                what = "an int" if kinds == (int,) else "a number"
                raise DirectoryURLError(f"{name} must be {what}, got {x!r:.40}")
        if not (0.05 <= ttl <= 3600 and 0 < timeout <= 60):
            raise DirectoryURLError(
                f"ttl in [0.05, 3600] s and timeout in (0, 60] s: {ttl}, {timeout}"
            )
        if not (1 <= buckets <= 1 << 24) or (shards is not None and not 1 <= shards <= 1024):
            raise DirectoryURLError(
                f"buckets in [1, 2^24], shards in [1, 1024]: {buckets}, {shards}"
            )
        check_url(url)
        self.url, self.namespace, self.ttl, self.timeout = url, namespace, ttl, timeout
        self._want = (buckets, shards)
        self._options = dict(client_options or {})
        self.cluster = False
        self.layout = Layout(namespace, buckets, shards or 1)
        self._client: Client = self._make(cluster=False)
        self._links: Links | None = None  # a standalone server's locate (wire.py)
        self._live = b""  # LIVE as a RESP command, for them
        self.refused_entries = 0
        """Entries read back that tierkv never writes (a node address no client could reach,
        a number out of range, a key's value of no whole node numbers), left out of every
        answer: written into Redis by another writer (hostile, or an older tierkv)."""

    def _make(self, *, cluster: bool) -> Client:
        opts: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            **self._options,
        }
        try:
            client: Client = (
                RedisCluster.from_url(self.url, **opts)
                if cluster
                else Redis.from_url(self.url, **opts)
            )
            # replies as bounded as on our own connections (wire.py): a locate's script reply
            # is the largest
            return bounded(
                client, max_bulk=reply_bytes(LOCATE_BATCH), max_reply=reply_bytes(LOCATE_BATCH)
            )
        except (ValueError, TypeError, RedisError) as exc:
            raise DirectoryURLError(f"bad directory url or option ({self.url!r}): {exc}") from exc

    @property
    def client(self) -> Client:
        """The redis-py client (standalone or Cluster, as found by `connect`)."""
        return self._client

    def stats(self) -> dict[str, int]:
        """The directory's counters."""
        return {"directory_refused_entries_total": self.refused_entries}

    def _live_set(self, flat: Any) -> dict[int, str]:
        live, refused = live_set(flat)
        self.refused_entries += refused
        return live

    @property
    def ttl_ms(self) -> int:
        """The registration ttl in milliseconds."""
        return int(self.ttl * 1000)

    @property
    def live_ms(self) -> int:
        """How long a registration lives past the refresh that Redis last executed: ttl less
        5 %, so that a refresh still queued in Redis when its node died (executed a little
        after the death) leaves the node live less than ttl after it died (measured: 1 ms
        late at ttl 2 s without the margin, on a loaded box)."""
        return self.ttl_ms - self.ttl_ms // 20

    # -- life cycle ----------------------------------------------------------------------
    async def connect(self) -> RedisDirectory:
        """Reach the server, tell a Cluster from a standalone server, read (or set) the layout.
        Raises DirectoryAuthError, DirectoryError (unreachable, or not a Redis that runs Lua)."""
        try:
            await self._open_links()
            if await self._cluster_enabled() and not self.cluster:
                await self._client.aclose()
                self.cluster = True
                await self._open_links()  # (none: a Cluster's replies are redis-py's)
                self._client = self._make(cluster=True)
                await asyncio.wait_for(self._client.initialize(), self.timeout)
            await self._read_layout()
        except AuthenticationError as exc:
            raise DirectoryAuthError(
                f"the directory at {self._where()} refused our credentials: {exc}"
            ) from exc
        except ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise DirectoryAuthError(
                    f"the directory at {self._where()} needs a password: {exc}"
                ) from exc
            raise DirectoryError(f"the directory at {self._where()} refused: {exc}") from exc
        except (RedisError, OSError, TimeoutError) as exc:
            raise DirectoryError(
                f"cannot reach the directory at {self._where()}: {type(exc).__name__}: {exc}"
            ) from exc
        return self

    def _where(self) -> str:
        return re.sub(r"//[^@/]*@", "//***@", self.url)  # never log a password

    async def _command(self, *args: bytes | str | int) -> Any:
        """One command: on our own connections where there are some (a hostile server's
        reply bounded), else redis-py's (its reply callbacks applied)."""
        if self._links is not None:
            return await command(self._links, *args)
        return await self._client.execute_command(*args)

    async def _cluster_enabled(self) -> bool:
        """Whether the server is a Redis Cluster node (INFO cluster)."""
        info = await asyncio.wait_for(self._command("INFO", "cluster"), self.timeout)
        if isinstance(info, dict):  # (redis-py parsed it)
            return bool(info.get("cluster_enabled"))
        if not isinstance(info, bytes):
            raise InvalidResponse(f"INFO cluster answered {info!r:.80}")
        return b"cluster_enabled:1" in info.split(b"\r\n")

    async def _read_layout(self) -> None:
        buckets, shards = self._want
        if shards is None:
            shards = CLUSTER_SHARDS if self.cluster else 1
        conf = self.layout.conf
        await self._command("HSETNX", conf, "buckets", buckets)
        await self._command("HSETNX", conf, "shards", shards)
        got = await self._command("HGETALL", conf)
        try:
            if isinstance(got, list):  # (raw: field, value, ...)
                got = dict(zip(got[::2], got[1::2], strict=True))
            buckets, shards = int(got[b"buckets"]), int(got[b"shards"])
        except (KeyError, ValueError, TypeError):
            buckets = shards = 0
        if not (1 <= buckets <= 1 << 24 and 1 <= shards <= 1024):  # the constructor's bounds
            raise DirectoryError(
                f"the directory at {self._where()} holds a layout ({conf}) tierkv never "
                f"writes: {got!r:.120}"
            )
        self.layout = Layout(self.namespace, buckets, shards)

    async def _open_links(self) -> None:
        """Our own connections on a standalone server whose URL they can follow (wire.py:
        plain commands, replies parsed in C and bounded: every call but a Cluster's goes
        there); None: redis-py's client, and locate by scripts."""
        if self._links is not None:
            await self._links.aclose()
        to = None if self.cluster else where(self._client)
        self._links = None if to is None else Links(to, self.timeout)
        meta = self.layout.meta_keys()
        self._live = resp(b"EVAL", LIVE, len(meta), *meta)

    async def aclose(self) -> None:
        """Close the client (and the locate connections)."""
        if self._links is not None:
            await self._links.aclose()
        await self._client.aclose()

    async def __aenter__(self) -> RedisDirectory:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _meta(self, script: str, *args: Any) -> Any:
        keys = self.layout.meta_keys()
        return (await self._pipeline(lambda p: p.evalsha(_SHA[script], len(keys), *keys, *args)))[0]

    async def _pipeline(self, build: Callable[[Any], Any]) -> list[Any]:
        """Run the commands ``build`` puts in a pipeline (one round trip); scripts go by
        EVALSHA, loaded again (every primary) when the server answers NOSCRIPT (restarted).
        On our own connections where there are some."""
        if self._links is not None:
            return await scripted(self._links, build, _SCRIPTS)
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        try:
            return list(await pipe.execute())
        except NoScriptError:
            pass
        for script in _SCRIPTS:
            await self._client.script_load(script)
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        return list(await pipe.execute())

    # -- membership ----------------------------------------------------------------------
    async def register(self, address: str, prev: int = 0, *, wait: bool = True) -> int:
        """Register ``address`` as a live node (for ttl); returns its new number. ``prev``: our
        own former number, retired (a node that lost Redis and comes back). An address held by
        another registration is waited for once, as long as that one has left (``wait``: a
        restarted node's former self lapses within ttl); raises NodeIdTakenError when it is
        still held then (a live node refreshes it). Raises InvalidTypeError /
        InvalidInputError for an address no client could reach (not a ``host:port`` str of at
        most `MAX_ADDRESS` characters): "", None, a port of 0 or 99999, 100 KB of text were
        registered, and every node's locate answered them as holders."""
        check_address(address)
        idx, left = registered(await self._meta(REGISTER, address, self.live_ms, prev))
        if idx < 0 and wait:
            await asyncio.sleep(max(0, min(left, self.ttl_ms)) / 1000 + 0.05)
            idx, left = registered(await self._meta(REGISTER, address, self.live_ms, prev))
        if idx < 0:
            raise NodeIdTakenError(
                f"node id {address!r} is held by a live node of the directory "
                f"{self._where()} (its registration lapses in {left} ms unless it refreshes)",
            )
        return idx

    async def refresh(self, number: int, address: str) -> bool:
        """Keep ``number`` live another ttl; False when it lapsed or was replaced (register
        again: what it published is no longer answered)."""
        return bool(await self._meta(REFRESH, number, address, self.live_ms))

    async def leave(self, number: int, address: str) -> None:
        """Leave now: nothing ``number`` published is answered any more (swept later)."""
        await self._meta(LEAVE, number, address)

    async def live(self) -> dict[int, str]:
        """The live nodes: number -> address."""
        return self._live_set(await self._meta(LIVE))

    # -- holdings ------------------------------------------------------------------------
    def _by_shard(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        if self.layout.shards == 1:
            return {0: list(range(len(keys)))}
        out: dict[int, list[int]] = {}
        shard_of = self.layout.shard_of
        for i, k in enumerate(keys):
            out.setdefault(shard_of(k), []).append(i)
        return out

    def _eval(self, pipe: Any, script: str, shard: int, *args: Any) -> None:
        prefix = self.layout.shard_prefix(shard)
        pipe.evalsha(_SHA[script], 1, prefix, prefix, self.layout.mask, *args)

    async def publish(self, number: int, add: Sequence[bytes], drop: Sequence[bytes] = ()) -> int:
        """Record that node ``number`` holds ``add`` and no longer holds ``drop``: scripts of
        `PUBLISH_BATCH` keys per shard, one round trip per batch (a full set of 10^5 keys is
        25 trips, and Redis serves other clients between them: one pipeline of them all
        blocked it for seconds when many nodes republished at once); returns the entries
        added.
        Raises InvalidInputError for a key that is not a content page key."""
        check_keys(add)
        check_keys(drop)
        me = number.to_bytes(4, "little")
        adds, drops = self._by_shard(add), self._by_shard(drop)
        fixed = fixed_length(add, drop)
        calls: list[tuple[int, bytes, bytes]] = []
        for shard in sorted(adds.keys() | drops.keys()):
            a = [add[i] for i in adds.get(shard, [])]
            d = [drop[i] for i in drops.get(shard, [])]
            for lo in range(0, max(len(a), len(d)), PUBLISH_BATCH):
                hi = lo + PUBLISH_BATCH
                calls.append((shard, blob(a[lo:hi], fixed), blob(d[lo:hi], fixed)))
        if not calls:
            return 0

        added = 0
        per_trip = max(1, self.layout.shards)  # one batch of keys (a script per shard) a trip
        for at in range(0, len(calls), per_trip):  # Redis serves others between the batches

            def build(
                pipe: Any, part: list[tuple[int, bytes, bytes]] = calls[at : at + per_trip]
            ) -> None:
                for shard, a, d in part:
                    self._eval(pipe, PUBLISH, shard, me, fixed, a, d)

            added += counted(await self._pipeline(build), "entries added")
        return added

    async def holders(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, ...]], dict[int, str]]:
        """Per key the live numbers holding it, and the live nodes (number -> address): one
        round trip (the live set, then one HGET per key; on a Cluster one script per shard and
        `LOCATE_BATCH` keys)."""
        if self._links is not None:
            live, values = await self._hgets(keys)
            return self._entries(values, {n: n for n in live}), live
        live, replies = await self._locate(keys)
        return _answers(len(keys), replies, {n: n for n in live}.get), live

    async def locate(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """Per key, the addresses of the live nodes holding it (empty: none known); tuples,
        one shared by every key of a node (no object made per key)."""
        if self._links is not None:
            live, values = await self._hgets(keys)
            return self._entries(values, live)
        live, replies = await self._locate(keys)
        return _answers(len(keys), replies, live.get)

    def _entries(self, values: list[Any], names: Mapping[int, T]) -> list[tuple[T, ...]]:
        got, refused = _by_value(values, names)
        self.refused_entries += refused
        return got

    async def _hgets(self, keys: Sequence[bytes]) -> tuple[dict[int, str], list[Any]]:
        """A standalone server: the live set (LIVE) and one HGET per key, one write on a
        connection of our own (wire.py); the live set and each key's reply (None: no entry).
        Raises InvalidInputError for a key that is not a content page key."""
        assert self._links is not None
        keys_blob, fixed = pack(keys)
        request = self.layout.hgets(keys_blob, fixed, keys)
        replies = await self._links.trip(self._live + request, len(keys) + 1)
        live = self._live_set(replies[0])
        del replies[0]  # (a memmove of 1,000 pointers)
        return live, replies

    async def _locate(self, keys: Sequence[bytes]) -> tuple[dict[int, str], list[_Reply]]:
        """The live set and, per script, the keys' places (None: in order) and its reply.
        Raises InvalidInputError for a key that is not a content page key."""
        keys_blob, fixed = pack(keys)
        lay = self.layout
        calls: list[tuple[int, bytes, list[int] | None]] = []
        if lay.shards == 1 and fixed:  # slices of the blob: no step per key
            step = LOCATE_BATCH * fixed
            for lo in range(0, len(keys_blob), step):
                calls.append((0, lay.records(0, keys_blob[lo : lo + step], fixed, ()), None))
        else:
            for lo in range(0, len(keys), LOCATE_BATCH):
                part = keys[lo : lo + LOCATE_BATCH]
                for shard, idx in self._by_shard(part).items():
                    mine = [part[i] for i in idx]
                    calls.append(
                        (
                            shard,
                            lay.records(shard, blob(mine, fixed), fixed, mine),
                            [lo + i for i in idx],
                        )
                    )
        meta = lay.meta_keys()

        def build(pipe: Any) -> None:
            pipe.evalsha(_SHA[LIVE], len(meta), *meta)
            for shard, records, _ in calls:
                prefix = lay.shard_prefix(shard)
                pipe.evalsha(_SHA[LOCATE], 1, prefix, len(prefix.encode()) + 2, fixed, records)

        replies = await self._pipeline(build)
        live = self._live_set(replies[0])
        if len(replies) != len(calls) + 1:
            raise InvalidResponse(f"{len(replies)} replies to {len(calls) + 1} commands")
        out: list[_Reply] = []
        for (_, _, order), r in zip(calls, replies[1:]):
            counts, held, refused = script_reply(r)
            self.refused_entries += refused
            out.append((order, counts, held))
        return live, out

    # -- sweeping ------------------------------------------------------------------------
    async def sweep(self, *, max_dead: int = 4096) -> int:
        """Remove the entries of dead nodes (lapsed or replaced), if no other node is sweeping;
        returns the entries removed. One pass over every bucket: O(entries) server work, in
        scripts of `SWEEP_BUCKETS` buckets (the server serves others between them)."""
        lay = self.layout
        picked = await self._command("SRANDMEMBER", lay.dead, max_dead)
        dead = node_numbers(picked, "the dead set")
        if not dead:
            return 0
        lock_ms = max(self.ttl_ms * 4, 60_000)
        if not await self._command("SET", lay.sweep_lock, b"1", "NX", "PX", lock_ms):
            return 0
        dead_blob = b"".join(n.to_bytes(4, "little") for n in dead)
        removed = 0
        try:
            for shard in range(lay.shards):
                prefix = lay.shard_prefix(shard)
                starts = list(range(0, lay.per_shard, SWEEP_BUCKETS))
                for at in range(0, len(starts), SWEEP_PIPELINE):  # others are served between

                    def build(
                        pipe: Any,
                        part: list[int] = starts[at : at + SWEEP_PIPELINE],
                        pre: str = prefix,
                    ) -> None:
                        for lo in part:
                            hi = min(lo + SWEEP_BUCKETS, lay.per_shard) - 1
                            pipe.evalsha(_SHA[SWEEP], 1, pre, pre, lo, hi, dead_blob)

                    removed += counted(await self._pipeline(build), "entries removed")
            await self._command("SREM", lay.dead, *dead)
        finally:
            await self._command("DEL", lay.sweep_lock)
        return removed
