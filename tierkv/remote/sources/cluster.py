"""`RemoteCluster`: the page servers of a cluster as one `PageSource`.

::

    cluster = RemoteCluster(["10.0.0.7:7600"], directory="redis://10.0.0.5:6379/0",
                            transport="tcp", secret=s, spec=spec)
    n = await cluster.lookup(keys)           # locate(keys): one live node per leading page
    got = await cluster.load(keys, arr, slots)   # runs of pages, each from the node holding it
                                                 #   A A A B B C -> A.load(3), B.load(2), C.load(1)
    await cluster.publish(keys, arr, slots)  # to the first seed that answers

With a ``directory`` (tierkv.remote.membership: the page servers publish what they hold there),
`locate` is one round trip to Redis per 1,000 keys, and any live node may serve; a directory
that fails or is slow answers "not known" (misses, counted in ``directory_errors``, a warning),
never an exception. Without one, the cluster is the ``seeds`` alone: `locate` asks each of them
which leading pages it holds, one run at a time.

Clients (`RemoteTier`) connect lazily, one per node, and are dropped when they fail; a node
that failed is skipped for ``retry_after`` seconds (its pages count as not held).
"""

from __future__ import annotations

import asyncio
import time
from ssl import SSLContext
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tierkv import validate
from tierkv.errors import InvalidInputError, InvalidTypeError, SpecError
from tierkv.failures import FailureLog
from tierkv.page_sums import PageCheck
from tierkv.remote.errors import (
    DirectoryError,
    PeerGoneError,
    RemoteError,
    RemoteProtocolError,
    RemoteTimeoutError,
)
from tierkv.remote.protocol.control import split_address
from tierkv.remote.protocol.exposure import resolve_secret
from tierkv.remote.protocol.tenancy import TenantKeys
from tierkv.remote.sources.client import RemoteTier
from tierkv.spec import KVSpec
from tierkv.tenant_names import check_tenant

if TYPE_CHECKING:  # the directory needs the `redis` extra: imported when one is given
    from tierkv.remote.membership.redis_directory import RedisDirectory

__all__ = ["RemoteCluster"]


class RemoteCluster:
    """Several page servers as one page source (see the module docstring).

    Args:
        seeds: ``host:port`` of page servers of the cluster (publishes go to the first that
            answers; without a directory, the cluster is these nodes).
        directory: the cluster directory: a URL (``redis://``, ``rediss://``, with a password
            or not) or a `RedisDirectory`. None: ask the seeds.
        transport, secret, spec, timeout, transport_options, ssl, tenant: as for
            `RemoteTier`, for every node. A tenant's pages are in the directory under its own
            keys (tierkv.remote.protocol.tenancy): we locate them there under those.
        retry_after: seconds a node that failed is left alone.
    """

    def __init__(
        self,
        seeds: list[str] | str | None = None,
        *,
        directory: str | RedisDirectory | None = None,
        transport: str = "tcp",
        secret: bytes | None = None,
        spec: KVSpec | None = None,
        timeout: float = 10.0,
        transport_options: dict[str, Any] | None = None,
        retry_after: float = 1.0,
        ssl: SSLContext | None = None,
        tenant: str | None = None,
    ) -> None:
        timeout = validate.seconds("timeout", timeout)
        retry_after = validate.seconds("retry_after", retry_after, allow_zero=True)
        if seeds is not None and not isinstance(seeds, str | list | tuple):
            raise InvalidTypeError(f"seeds: a list of 'host:port' str, got {type(seeds).__name__}")
        self.seeds = [seeds] if isinstance(seeds, str) else list(seeds or [])
        for seed in self.seeds:
            split_address(seed)  # (InvalidTypeError / InvalidInputError now, not at a load)
        if not self.seeds and directory is None:
            raise InvalidInputError("a cluster needs a directory or at least one seed address")
        if isinstance(directory, str):
            from tierkv.remote.membership.redis_directory import RedisDirectory

            directory = RedisDirectory(directory)
        self.directory = directory
        self._dir_ready: asyncio.Future[None] | None = None  # the directory's connect
        self.directory_errors = 0
        self._failures = FailureLog("tierkv.remote.directory", tracebacks=False)
        self._kw: dict[str, Any] = {
            "transport": transport,
            "secret": secret,
            "spec": spec,
            "timeout": timeout,
            "transport_options": transport_options,
            "ssl": ssl,
            "tenant": None if tenant is None else check_tenant(tenant),
        }
        self._keys = (
            None if tenant is None else TenantKeys(tenant, resolve_secret(secret, insecure=True))
        )
        self.retry_after = retry_after
        self._tiers: dict[str, RemoteTier] = {}
        self._down: dict[str, float] = {}
        self._connecting: dict[str, asyncio.Future[RemoteTier]] = {}
        self.loads_from: dict[str, int] = {}

    async def node(self, address: str) -> RemoteTier:
        """The client of one node (connected now if needed). Raises RemoteError (PeerGoneError
        while the node is left alone after a failure)."""
        tier = self._tiers.get(address)
        if tier is not None:
            return tier
        until = self._down.get(address, 0.0)
        if time.monotonic() < until:
            raise PeerGoneError(
                f"{address} failed recently; retrying in {until - time.monotonic():.1f} s"
            )
        pending = self._connecting.get(address)
        if pending is not None:  # one connect per node, whoever asks
            return await asyncio.shield(pending)
        fut: asyncio.Future[RemoteTier] = asyncio.get_running_loop().create_future()
        self._connecting[address] = fut
        try:
            try:
                client = RemoteTier(address, **self._kw)
            except InvalidInputError as exc:  # a directory's entry: the Redis is not ours
                raise RemoteProtocolError(f"node address {address!r:.80}: {exc}") from None
            tier = await client.connect()
        except BaseException as exc:
            if isinstance(exc, Exception):
                self._down[address] = time.monotonic() + self.retry_after
                fut.set_exception(exc)
                fut.exception()  # retrieved: whoever waits re-raises it
            else:
                fut.cancel()
            raise
        finally:
            self._connecting.pop(address, None)
        self._tiers[address] = tier
        fut.set_result(tier)
        return tier

    async def _failed(self, address: str) -> None:
        self._down[address] = time.monotonic() + self.retry_after
        tier = self._tiers.pop(address, None)
        if tier is not None:
            await tier.aclose()

    async def _seed(self) -> tuple[str, RemoteTier]:
        last: RemoteError | None = None
        for a in self.seeds:
            try:
                return a, await self.node(a)
            except RemoteError as exc:
                last = exc
        raise PeerGoneError(f"no seed of {self.seeds} answers: {last}") from last

    async def _call_seed(self, op: str, *args: Any) -> Any:
        address, tier = await self._seed()
        try:
            return await getattr(tier, op)(*args)
        except (PeerGoneError, RemoteTimeoutError):
            await self._failed(address)
            raise

    async def locate(self, keys: list[bytes]) -> list[str]:
        """Per leading page of ``keys``, a live node holding it (the directory's answer, or
        the seeds'); shorter than ``keys`` from the first page no node is known to hold."""
        if self.directory is None:
            return await self._ask_seeds(keys)
        from redis.exceptions import RedisError  # (the directory imported redis already)

        try:
            holders = await asyncio.wait_for(self._holders(keys), self.directory.timeout)
        except (RedisError, OSError, TimeoutError, DirectoryError) as exc:
            self.directory_errors += 1
            self._failures.report("directory locate", exc, tier="directory", keys=keys)
            return []  # not known: misses, never an error into the store
        out: list[str] = []
        now = time.monotonic()
        for nodes in holders:
            if self._down:
                nodes = tuple(n for n in nodes if self._down.get(n, 0.0) <= now)
            if not nodes:
                break
            out.append(out[-1] if out and out[-1] in nodes else nodes[0])  # runs stay whole
        return out

    async def _connect_directory(self) -> None:
        assert self.directory is not None
        await self.directory.connect()

    async def _holders(self, keys: list[bytes]) -> list[tuple[str, ...]]:
        assert self.directory is not None
        ready = self._dir_ready
        if ready is None or (ready.done() and (ready.cancelled() or ready.exception())):
            ready = self._dir_ready = asyncio.ensure_future(self._connect_directory())
        await asyncio.shield(ready)
        return await self.directory.locate(keys if self._keys is None else self._keys.keys(keys))

    async def _ask_seeds(self, keys: list[bytes]) -> list[str]:
        """No directory: at each position, the seed holding the longest run from there.
        Raises the last error when no seed answers (as one unreachable page server does)."""
        failed: list[RemoteError] = []

        async def ask(address: str, part: list[bytes]) -> list[str]:
            try:
                found: list[str] = await (await self.node(address)).locate(part)
                return found
            except RemoteError as exc:
                if isinstance(exc, (PeerGoneError, RemoteTimeoutError)):
                    await self._failed(address)
                failed.append(exc)
                return []

        out: list[str] = []
        while len(out) < len(keys):
            failed.clear()
            part = keys[len(out) :]
            runs = await asyncio.gather(*(ask(a, part) for a in self.seeds))
            if len(failed) == len(self.seeds):
                raise failed[-1]
            best = max(runs, key=len)
            if not best:
                break
            out += best
        return out

    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` some node of the cluster holds."""
        return len(await self.locate(keys))

    #: each node's client verifies page checksums: `load` reports them (tierkv.page_source)
    checks_pages = True
    tier_label = "peer"

    async def load(
        self,
        keys: list[bytes],
        array: npt.NDArray[np.uint8],
        slots: list[int],
        check: PageCheck | None = None,
    ) -> int:
        """Read the leading pages of ``keys`` from the nodes holding them into
        ``array[slots]``; returns how many leading pages arrived intact (each checked against
        its checksum by the node's client; ``check`` gathers their verdicts). Raises
        RemoteError when the first node asked fails (a later failure ends the load short)."""
        if len(slots) < len(keys):
            raise SpecError(f"{len(slots)} local slots for {len(keys)} pages")
        nodes = await self.locate(keys)
        got = 0
        while got < len(nodes):
            node, end = nodes[got], got
            while end < len(nodes) and nodes[end] == node:
                end += 1
            part = PageCheck()
            try:
                tier = await self.node(node)
                n = await tier.load(keys[got:end], array, slots[got:end], part)
            except RemoteError as exc:
                if isinstance(exc, (PeerGoneError, RemoteTimeoutError)):
                    await self._failed(node)
                if got == 0:
                    raise
                return got
            self.loads_from[node] = self.loads_from.get(node, 0) + n
            if check is not None:
                check.corrupt += part.corrupt
                check.sums += part.sums[:n]
            got += n
            if got < end:
                break
        return got

    async def publish(
        self,
        keys: list[bytes],
        array: npt.NDArray[np.uint8],
        slots: list[int],
        sums: list[int] | None = None,
    ) -> int:
        """Write pages to the seed's node (``sums``: their checksums, see
        `RemoteTier.publish`); returns the pages newly stored there."""
        stored: int = await self._call_seed("publish", keys, array, slots, sums)
        return stored

    async def aclose(self) -> None:
        """Close every node's client and the directory's."""
        tiers, self._tiers = list(self._tiers.values()), {}
        for t in tiers:
            await t.aclose()
        if self.directory is not None:
            await self.directory.aclose()
            self._dir_ready = None

    async def __aenter__(self) -> RemoteCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
