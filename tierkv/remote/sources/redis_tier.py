"""`RedisTier`: a remote tier on Redis / Valkey (one server or a Redis Cluster). This file
stays whole (~500 lines): one class whose calls share the availability state, the backoff and
the rate-limited log; the value layout (redis_value.py) and the ASK follower (redis_ask.py) are
apart already.

::

    async with RedisTier("redis://cache:6379/0", spec=spec, namespace="llama-3.1-8b") as rt:
        n = await rt.lookup(page_keys)                        # leading pages present
        got = await rt.load(page_keys[:n], arena.array, slots)  # verified pages -> local slots
        stored = await rt.publish(keys, arena.array, slots)     # SET NX (PX ttl)

One page is one value (layout: `tierkv.remote.sources.redis_value`), under a key that names the
namespace, the page layout and the page; with a ``tenant``, the tenant too (``...:t:<tenant>:``
before the page), so that an operator can confine each tenant's Redis user to its own keys with
an ACL (``~tkv:*:t:<tenant>:*``, docs/security.md, *Tenants*).

No hash tag: a prompt's pages spread over all slots of a cluster. A value that fails any check
(length, magic, format, codec, layout, checksum: the checksum binds the value to its key; then
the page's own CRC-32C, carried in the header from the publisher's page table, against the
bytes as they landed) is a miss, counted in ``corrupt``, logged (rate-limited) and deleted, so
a later publish repairs it. So is a key of another type (a list, a hash) at a page's key, found
by a lookup (STRLEN, as cheap as EXISTS, answers WRONGTYPE), a load (GET/GETEX answer
WRONGTYPE; MGET answers nil, so one TYPE of the key where a load stopped) or a publish (a SET
NX that stored nothing is followed by a STRLEN of those keys, one more round trip only then):
a publish that finds one deletes it and stores the page.

Failures never reach the caller: every call is bounded by ``timeout``; a call that fails or
times out returns misses (``0``), marks the tier unavailable and drops the client; later calls
return misses at once until a backoff (doubling from ``backoff_base`` up to ``backoff_cap``)
has passed, then try with a fresh client. Only caller bugs raise (SpecError).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierkv import page_sums
from tierkv.errors import SpecError
from tierkv.page_sums import NO_SUM, PageCheck, row_sums
from tierkv.remote.membership.bounded import bounded
from tierkv.remote.sources.redis_ask import AskFollower, follow_failed
from tierkv.remote.sources.redis_value import (
    FORMAT,
    HEADER_BYTES,
    check_value,
    encode_value,
    page_sum,
    spec_digest,
    value_header,
)
from tierkv.spec import KVSpec
from tierkv.tenant_names import check_tenant
from tierkv.transports.crc32c_native import crc32c

__all__ = ["BATCH_PAGES", "HEADER_BYTES", "RedisTier", "redis_prefix"]

log = logging.getLogger("tierkv.remote.redis")

BATCH_PAGES = 64
"""Pages per MGET / pipeline; chunks of a call run concurrently (docs/redis.md, measured)."""

_NAMESPACE = re.compile(r"[A-Za-z0-9._/@+=-]{1,128}")
Pages = npt.NDArray[np.uint8]
Client = Redis | RedisCluster
_T = TypeVar("_T")


class _Warnings:
    """At most one warning per kind every ``interval`` seconds; says how many it held back."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        log.warning(msg + (f" ({held} similar held back)" if held else ""), *args)


class RedisTier:
    """Pages in Redis / Valkey under their content keys: a `PageSource`.

    Args:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS); with
            ``cluster=True`` any node of the cluster.
        spec: the page layout; pages of another layout are never read.
        namespace: what shares pages (the model id); letters, digits and ``._/@+=-``.
        cluster: use Redis Cluster (redirections and slot moves are handled by redis-py).
        ttl: seconds a page lives after its last publish or load (None: until evicted).
        timeout: the bound of every call, connect included, in seconds.
        batch_pages: pages per MGET / pipeline; the chunks of one call run concurrently.
        tenant: whose pages these are: every key it reads and writes carries it (None: no
            tenant, the keys of a tierkv without tenants). Pages of another tenant, or of
            none, are never read.
        client_options: extra keyword arguments for ``Redis.from_url`` /
            ``RedisCluster.from_url`` (``username``, ``password``, ``ssl_ca_certs``...).

    Raises SpecError for a bad namespace, ttl, timeout, batch_pages or url; TenantError for a
    bad tenant name.
    """

    backoff_base = 0.1
    """Seconds before the first reconnection attempt after a failure (then doubling)."""
    backoff_cap = 5.0
    """The longest wait between reconnection attempts."""
    in_flight = 2
    """Chunks of one call in flight at once (each on its own pooled connection)."""
    checks_pages = True
    """`load` verifies pages' CRC-32C and reports them (tierkv.page_source.load_checked)."""
    tier_label = "redis"
    """The label of its corrupt pages in a store's counters."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        spec: KVSpec,
        namespace: str = "default",
        cluster: bool = False,
        ttl: float | None = None,
        timeout: float = 1.0,
        batch_pages: int = BATCH_PAGES,
        tenant: str | None = None,
        **client_options: Any,
    ) -> None:
        self.tenant = None if tenant is None else check_tenant(tenant)
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise SpecError(f"namespace must match {_NAMESPACE.pattern}, got {namespace!r}")
        if ttl is not None and not _seconds(ttl):
            raise SpecError(f"ttl must be positive seconds or None, got {ttl!r:.40}")
        if not _seconds(timeout):
            raise SpecError(f"timeout must be positive seconds, got {timeout!r:.40}")
        if isinstance(batch_pages, bool) or not isinstance(batch_pages, int) or batch_pages < 1:
            raise SpecError(f"batch_pages must be a positive int, got {batch_pages!r}")
        self.url, self.spec, self.namespace = url, spec, namespace
        self.cluster, self.ttl, self.timeout, self.batch_pages = cluster, ttl, timeout, batch_pages
        self._options = client_options
        self._digest = spec_digest(spec)
        self._prefix = redis_prefix(namespace, self._digest, self.tenant)
        self._page_bytes = spec.page_bytes
        self._head = value_header(self._digest, spec.page_bytes)
        self._px = None if ttl is None else max(1, round(ttl * 1000))
        self._client: Client | None = None
        self._make_client()  # a bad url is a caller bug: raise now, not at the first call
        self._ask = self._follower()
        self._available = False
        self._ever_up = False
        self._failures = 0
        self._retry_at = 0.0
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()
        self.server_policy: str | None = None
        """The server's ``maxmemory-policy`` as read by `connect` (None: unknown)."""
        self._warn = _Warnings()
        self._stats: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "corrupt", "errors", "timeouts", "reconnects", "bytes_in",
             "bytes_out", "stored", "present", "full"), 0)  # fmt: skip

    def _make_client(self) -> Client:
        opts: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            **self._options,
        }
        try:
            if self.cluster:
                client: Client = RedisCluster.from_url(self.url, **opts)
            else:
                opts.setdefault("retry", Retry(NoBackoff(), 0))  # we retry, with backoff
                client = Redis.from_url(self.url, **opts)
        except (ValueError, TypeError, RedisError) as exc:
            raise SpecError(f"bad Redis url or client option ({self.url!r}): {exc}") from exc
        self._client = bounded(client, **self._bounds)
        return client

    @property
    def _bounds(self) -> dict[str, int]:
        """What a reply may make us allocate (`tierkv.remote.membership.bounded`): a bulk of
        one page's value (or 64 KiB: a topology or config reply), a reply of ``batch_pages``
        values (an MGET) and 4 MiB more. A hostile server's ``*4294967295`` or a value of a
        TiB is an InvalidResponse, a counted miss, before anything is allocated."""
        value = HEADER_BYTES + self._page_bytes
        return {
            "max_bulk": max(value, 64 << 10),
            "max_reply": self.batch_pages * (value + 64) + (4 << 20),
        }

    def _follower(self) -> AskFollower:
        keep = ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
        opts = {k: v for k, v in self._options.items() if k in keep}
        return AskFollower(
            self._bounds, socket_timeout=self.timeout, socket_connect_timeout=self.timeout, **opts
        )

    # -- life cycle ----------------------------------------------------------------------
    async def connect(self) -> RedisTier:
        """Reach the server (PING, bounded by ``timeout``). Never raises for an unreachable
        server: the tier starts unavailable and keeps trying (see `available`)."""
        self._closed = False
        await self._run("connect", self._ping)
        return self

    async def _ping(self, client: Client) -> None:
        await client.ping()
        try:  # managed services may refuse CONFIG: then we cannot tell, and say nothing
            reply = await client.config_get("maxmemory-policy")
        except RedisError:
            return
        policy = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
        self.server_policy = policy.decode() if isinstance(policy, bytes) else policy
        if self.server_policy == "noeviction":
            log.warning(
                "Redis tier %s: maxmemory-policy noeviction: publishes fail once the server is "
                "full (counted in 'full'); allkeys-lru suits a cache", self.url,
            )  # fmt: skip
        elif self.server_policy and self.server_policy.startswith("volatile") and not self.ttl:
            log.warning(
                "Redis tier %s: maxmemory-policy %s evicts only keys with a TTL, and ttl=None: "
                "our pages are never evicted", self.url, self.server_policy,
            )  # fmt: skip

    async def aclose(self) -> None:
        """Close the client's connections (waits at most ``timeout``). Idempotent; calls
        made after it are misses, until `connect` again."""
        self._closed = True
        self._available = False
        self._drop_client()
        if self._closing:
            await asyncio.wait(self._closing, timeout=self.timeout)

    def _drop_client(self) -> None:
        """Forget the client; its connections close in the background (bounded by
        ``timeout``), so that a failed call returns within its own bound."""
        client, self._client = self._client, None
        follower, self._ask = self._ask, self._follower()
        for closing in (
            self._close(client) if client is not None else None,
            follower.aclose() if len(follower) else None,
        ):
            if closing is not None:
                task = asyncio.get_running_loop().create_task(closing)
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def _close(self, client: Client) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout):
                await client.aclose()

    async def __aenter__(self) -> RedisTier:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- health --------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether the last call reached the server (False before `connect` and after a
        failure, until a later call gets through)."""
        return self._available

    def stats(self) -> dict[str, int | float]:
        """Counters: ``hits`` / ``misses`` (pages asked of `load`), ``corrupt`` (values that
        failed a check), ``errors`` / ``timeouts`` (failed calls), ``reconnects``,
        ``bytes_in`` / ``bytes_out`` (values), ``stored`` / ``present`` (publish: new, already
        there), ``full`` (pages refused for lack of memory), ``available`` (0 or 1)."""
        out: dict[str, int | float] = dict(self._stats)
        out["available"] = int(self._available)
        return out

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of page ``key`` in this namespace, layout and tenant."""
        return self._prefix + key.hex().encode()

    async def _run(self, what: str, fn: Any, *args: Any) -> Any:
        """``await fn(client, *args)`` bounded by ``timeout``; None on failure (counted, logged,
        backoff) or while backing off."""
        loop_now = time.monotonic()
        if self._closed or (not self._available and loop_now < self._retry_at):
            return None
        try:
            async with asyncio.timeout(self.timeout):
                client = self._client or self._make_client()
                result = await fn(client, *args)
        except (TimeoutError, RedisTimeoutError) as exc:
            self._stats["timeouts"] += 1
            self._failed(what, exc)
            return None
        except Exception as exc:
            # RedisError, OSError, RedisClusterException (not a RedisError); and AttributeError
            # or RuntimeError from redis-py's cluster client when a MOVED storm resets it under
            # a call: all of them misses, never the caller's problem
            self._stats["errors"] += 1
            self._failed(what, exc)
            return None
        if not self._available:
            if self._ever_up:
                self._stats["reconnects"] += 1
                log.info("Redis tier %s reachable again", self.url)
            self._available = self._ever_up = True
        self._failures = 0
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        self._available = False
        self._failures += 1
        delay = min(self.backoff_cap, self.backoff_base * 2 ** min(self._failures - 1, 30))
        self._retry_at = time.monotonic() + delay
        self._warn.warn(
            "down", "Redis tier %s: %s failed (%s: %s); misses, next try in %.2g s",
            self.url, what, type(exc).__name__, exc, delay,
        )  # fmt: skip
        self._drop_client()  # a connection may hold a late reply: start afresh

    # -- argument checks (caller bugs raise) ---------------------------------------------
    def _check(self, keys: list[bytes], array: Pages, slots: list[int], write: bool) -> None:
        pb = self.spec.page_bytes
        if not isinstance(array, np.ndarray) or array.ndim != 2 or array.dtype != np.uint8:
            raise SpecError(f"pages must be a uint8 array [n, {pb}], got {_describe(array)}")
        if array.shape[1] != pb:
            raise SpecError(f"pages must be [n, {pb}] (spec.page_bytes), got {array.shape}")
        if write and not array.flags.writeable:
            raise SpecError("the local page array is read-only")
        if (len(slots) < len(keys)) if write else (len(slots) != len(keys)):
            raise SpecError(f"{len(slots)} local slots for {len(keys)} pages")
        n = array.shape[0]
        for s in slots[: len(keys)]:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < n:
                raise SpecError(f"local slot {s!r} is outside [0, {n})")
        if write and len(set(slots[: len(keys)])) != len(keys):
            raise SpecError("two pages for one local slot")
        for k in keys:
            if not isinstance(k, bytes) or not k:
                raise SpecError(f"a page key must be non-empty bytes, got {k!r}")

    async def _chunked(self, n: int, fn: Callable[[int, int], Awaitable[_T]]) -> list[_T]:
        """``fn(lo, hi)`` over ``[0, n)`` in chunks of ``batch_pages``, at most ``in_flight``
        at a time (each on its own connection), results in order."""
        if n <= self.batch_pages:  # one chunk: no task, no semaphore
            return [await fn(0, n)]
        sem = asyncio.Semaphore(self.in_flight)

        async def one(lo: int) -> _T:
            async with sem:
                return await fn(lo, min(n, lo + self.batch_pages))

        return list(await asyncio.gather(*(one(lo) for lo in range(0, n, self.batch_pages))))

    # -- lookup --------------------------------------------------------------------------
    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` are present (a hint: `load` verifies).
        Returns 0 when the server is unreachable, slow or backing off."""
        for k in keys:
            if not isinstance(k, bytes) or not k:
                raise SpecError(f"a page key must be non-empty bytes, got {k!r}")
        if not keys:
            return 0
        found = await self._run("lookup", self._exists, [self.redis_key(k) for k in keys])
        if found is None:
            return 0
        n = 0
        while n < len(keys) and found[n]:
            n += 1
        return n

    async def _exists(self, client: Client, rkeys: list[bytes]) -> list[bool]:
        async def chunk(lo: int, hi: int) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for k in rkeys[lo:hi]:
                pipe.strlen(k)  # as EXISTS (0: absent), and WRONGTYPE for another type
            return list(await pipe.execute(raise_on_error=False))

        found = [x for part in await self._chunked(len(rkeys), chunk) for x in part]
        self._refused("lookup", [x for x in found if not _wrongtype(x)])
        wrong = [k for k, x in zip(rkeys, found) if _wrongtype(x)]
        if wrong:  # a key of another type: corrupt, dropped so that a publish repairs it
            pipe = client.pipeline(transaction=False)
            for k in wrong:
                self._corrupt(k, "a key of another type")
                pipe.delete(k)
            await pipe.execute(raise_on_error=False)
        return [type(x) is int and x > 0 for x in found]

    def _refused(self, what: str, replies: list[Any]) -> None:
        """Count and log per-command error replies (a slot in transit, a server refusing)."""
        errs = [r for r in replies if isinstance(r, Exception)]
        if errs:
            self._stats["errors"] += 1
            self._warn.warn(
                "refused", "Redis tier %s: %s got %d error replies, first: %s",
                self.url, what, len(errs), errs[0],
            )  # fmt: skip

    # -- load ----------------------------------------------------------------------------
    async def load(
        self, keys: list[bytes], array: Pages, slots: list[int], check: PageCheck | None = None
    ) -> int:
        """Read the leading pages of ``keys`` into ``array[slots[i]]`` ([num_slots,
        page_bytes] uint8); returns how many arrived intact. Each value is checked (length,
        layout, checksum) before its row is written, and each row against the page's CRC-32C
        once written (one native call per chunk). Rows past the count may have been written
        (a later chunk that arrived, a page that failed its CRC) and hold no page; no row is
        written after the call returns. ``check``, when given, receives the delivered pages'
        checksums and how many values were corrupt.

        Never raises for server trouble (returns 0 or fewer pages); raises SpecError for a
        wrong array, out-of-range or repeated slots, fewer slots than keys.
        """
        self._check(keys, array, slots, write=True)
        if not keys:
            return 0
        rkeys = [self.redis_key(k) for k in keys]
        bad: list[bytes] = []
        sums: dict[int, int] = {}
        nil: list[bytes] = []  # the key whose MGET answer was nil, where the load stopped
        n = await self._run("load", self._load, rkeys, array, slots, bad, sums, nil)
        n = n or 0
        self._stats["hits"] += n
        self._stats["misses"] += len(keys) - n
        if nil and nil[0] == rkeys[n] and await self._run("type", self._wrong_type, nil[0]):
            self._corrupt(nil[0], "a key of another type")
            bad.append(nil[0])
        if check is not None:
            check.corrupt += len(bad)
            check.sums = [sums.get(i, NO_SUM) for i in range(n)]
        for rkey in bad:
            await self._run("delete", self._delete, rkey)
        return n

    async def _wrong_type(self, client: Client, rkey: bytes) -> bool:
        """True when ``rkey`` holds something else than a string (nil to MGET)."""
        kind = await client.type(rkey)
        return _decoded(kind) not in ("none", "string")

    def _corrupt(self, rkey: bytes, why: str) -> None:
        self._stats["corrupt"] += 1
        self._warn.warn("corrupt", "Redis tier: page %s rejected (%s); a miss", rkey, why)

    async def _load(
        self,
        client: Client,
        rkeys: list[bytes],
        array: Pages,
        slots: list[int],
        bad: list[bytes],
        sums: dict[int, int],
        nil: list[bytes],
    ) -> int:
        end = len(rkeys)  # the first page that did not arrive intact (so far)

        async def chunk(lo: int, hi: int) -> None:
            nonlocal end
            if lo >= end:
                return  # an earlier page is already a miss: skip the round trip
            values = await self._get(client, rkeys[lo:hi])
            self._refused("load", [v for v in values if not _wrongtype(v)])
            verify, got = self._verify, 0
            landed: dict[int, int] = {}  # page -> the CRC-32C its header declares
            try:
                for i, value in enumerate(values, lo):
                    if i >= end:
                        break
                    if value is None or isinstance(value, Exception):
                        end = i
                        if _wrongtype(value):  # a key of another type: corrupt, dropped
                            self._corrupt(rkeys[i], "a key of another type")
                            bad.append(rkeys[i])
                        elif value is None:
                            nil[:] = [rkeys[i]]
                        break
                    got += len(value)
                    payload = verify(rkeys[i], value)
                    if payload is None:
                        bad.append(rkeys[i])
                        end = min(end, i)
                        break
                    array[slots[i]] = payload  # verified as it arrives, others in flight
                    landed[i] = page_sum(value)
            finally:
                self._stats["bytes_in"] += got
            first = self._check_rows(rkeys, array, slots, landed, bad, sums)
            end = min(end, first)

        await self._chunked(len(rkeys), chunk)
        return end

    def _check_rows(
        self,
        rkeys: list[bytes],
        array: Pages,
        slots: list[int],
        landed: dict[int, int],
        bad: list[bytes],
        sums: dict[int, int],
    ) -> int:
        """Check the rows just written against their pages' CRC-32C (one native call);
        returns the first page that failed (len(rkeys) if none). The ones that did are
        counted, logged and listed in ``bad`` (deleted); the others' go to ``sums``."""
        if not landed or not page_sums.enabled():
            return len(rkeys)
        idx = list(landed)
        first = len(rkeys)
        for i, crc in zip(idx, row_sums(array, [slots[i] for i in idx])):
            if crc == landed[i]:
                sums[i] = crc
                continue
            first = min(first, i)
            bad.append(rkeys[i])
            self._stats["corrupt"] += 1
            self._warn.warn("corrupt", "Redis tier: page %s fails its CRC-32C; a miss", rkeys[i])
        return first

    async def _get(self, client: Client, rkeys: list[bytes]) -> list[Any]:
        if self._px is None and not self.cluster:
            return list(await client.mget(rkeys))  # one command: least parsing
        pipe = client.pipeline(transaction=False)
        for k in rkeys:
            if self._px is None:
                pipe.get(k)
            else:
                pipe.getex(k, px=self._px)  # a read renews the page's ttl
        values = list(await pipe.execute(raise_on_error=False))
        if isinstance(client, RedisCluster):  # reads of a half-moved slot: follow ASK ourselves
            await follow_failed(self._ask, client, rkeys, values, self._px)
        return values

    async def _delete(self, client: Client, rkey: bytes) -> None:
        await client.delete(rkey)

    def _verify(self, rkey: bytes, value: Any) -> Pages | None:
        """The payload of ``value`` as a uint8 array, or None (counted, logged) if any check
        fails."""
        why = check_value(rkey, value, self._head, self._page_bytes)
        if why is not None:
            self._corrupt(rkey, why)
            return None
        return np.frombuffer(value, np.uint8, self._page_bytes, HEADER_BYTES)

    # -- publish -------------------------------------------------------------------------
    async def publish(
        self, keys: list[bytes], array: Pages, slots: list[int], sums: list[int] | None = None
    ) -> int:
        """Store ``array[slots[i]]`` as page ``keys[i]`` unless present (SET NX, PX ttl);
        returns the pages newly stored. ``sums``: the pages' CRC-32C (from the page table),
        written into each value's header; by default computed from ``array`` now. Pages
        refused for lack of memory (``maxmemory`` with ``noeviction``) count in ``full``.
        Never raises for server trouble (returns what got stored, or 0); raises SpecError for
        a wrong array, bad slots, len(slots) != len(keys).
        """
        self._check(keys, array, slots, write=False)
        if not keys:
            return 0
        if sums is None or len(sums) != len(keys) or NO_SUM in sums:
            sums = row_sums(array, slots) if page_sums.enabled() else [0] * len(keys)
        rkeys = [self.redis_key(k) for k in keys]
        replies = await self._run("publish", self._set, rkeys, array, slots, sums)
        if replies is None:
            return 0
        stored = sum(1 for r in replies if r is True)
        full = sum(1 for r in replies if isinstance(r, OutOfMemoryError))
        failed = sum(1 for r in replies if isinstance(r, Exception)) - full
        self._stats["stored"] += stored
        self._stats["present"] += len(keys) - stored - full - failed
        self._stats["full"] += full
        self._stats["bytes_out"] += stored * (HEADER_BYTES + self.spec.page_bytes)
        if full:
            self._warn.warn("full", "Redis tier %s full: %d pages not stored", self.url, full)
        self._refused("publish", [r for r in replies if not isinstance(r, OutOfMemoryError)])
        return stored

    def _value(self, rkey: bytes, row: Pages, crc: int | None = None) -> bytes:
        data = np.ascontiguousarray(row).data
        return encode_value(rkey, self._head, data, crc32c(data) if crc is None else crc)

    async def _set(
        self, client: Client, rkeys: list[bytes], array: Pages, slots: list[int], sums: list[int]
    ) -> list[Any]:
        async def chunk(lo: int, hi: int) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for i in range(lo, hi):  # values built per chunk: one chunk's copies at a time
                value = self._value(rkeys[i], array[slots[i]], sums[i])
                pipe.set(rkeys[i], value, nx=True, px=self._px)
            replies = list(await pipe.execute(raise_on_error=False))
            held = [i for i, r in enumerate(replies, lo) if r is None]  # NX: something is there
            if not held:
                return replies
            pipe = client.pipeline(transaction=False)
            for i in held:  # WRONGTYPE when it is a key of another type
                pipe.strlen(rkeys[i])
            lengths = await pipe.execute(raise_on_error=False)
            wrong = [i for i, n in zip(held, lengths) if _wrongtype(n)]
            if not wrong:
                return replies
            pipe = client.pipeline(transaction=False)
            for i in wrong:  # repair: the key of another type goes, the page takes its place
                self._corrupt(rkeys[i], "a key of another type; replaced")
                pipe.delete(rkeys[i])
                value = self._value(rkeys[i], array[slots[i]], sums[i])
                pipe.set(rkeys[i], value, nx=True, px=self._px)
            fixed = list(await pipe.execute(raise_on_error=False))[1::2]
            for i, r in zip(wrong, fixed):
                replies[i - lo] = r
            return replies

        return [r for part in await self._chunked(len(rkeys), chunk) for r in part]


def _seconds(x: object) -> bool:
    """Whether ``x`` is a finite number of seconds > 0 (``ttl="5"`` was a TypeError of the
    comparison, ``ttl=inf`` an OverflowError at rounding, 10**400 a PX Redis refused)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return 0 < float(x) <= _MOST_SECONDS
    except OverflowError:
        return False


_MOST_SECONDS = 10.0**9  # (about 31 years: any longer ttl or timeout is a typo)


def redis_prefix(namespace: str, digest: bytes, tenant: str | None = None) -> bytes:
    """What every page key of ``namespace``, the layout of ``digest`` and ``tenant`` starts
    with: ``tkv:<namespace>:<FORMAT>.<digest, 8 hex>:`` then ``t:<tenant>:`` with a tenant.
    Neither a namespace nor a tenant holds a ``:`` and a page's hex never does, so no key of
    one tenant (or of none) matches another's ACL pattern ``~tkv:*:t:<tenant>:*``."""
    prefix = f"tkv:{namespace}:{FORMAT}.{digest[:4].hex()}:"
    return (prefix if tenant is None else f"{prefix}t:{tenant}:").encode()


def _wrongtype(reply: Any) -> bool:
    """A reply that says the key holds another type than a string."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _decoded(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _describe(array: object) -> str:
    if isinstance(array, np.ndarray):
        return f"{array.dtype} {array.shape}"
    return type(array).__name__
