"""`TierKVPeerTier`: vLLM's CPU-tier chunks on tierkv page servers (`tierkv serve`).

One chunk is one page of a page server's host tier: a store publishes the job's chunks to the
first seed that answers (`RemoteCluster.publish`: reserve, a one-sided write, commit with each
page's CRC-32C, the server verifying before it serves them); a load reads them one-sidedly
from whichever node holds them (`RemoteCluster.load`: the pages pinned by a lease, checked
against the checksums the server gave, the first page that fails and the rest a miss). With a
``directory`` (Redis / Valkey, `tierkv serve --directory`) lookups find any node of the
cluster in one round trip; without one, the ``peers`` are asked.

The page servers' pages are vLLM chunks, so each server runs with a page of exactly the
chunk's size: ``tierkv serve --layers 1 --kv-heads 1 --head-dim CHUNK/2 --dtype fp8
--page-tokens 1`` (docs/vllm.md). A seed that answers at startup with another page size, or
refuses our secret or transport, is a `VllmTierConfigError` then; a seed that does not answer
is not (it gives misses and failed stores until it does). A server killed or restarted gives
misses and failed jobs; its client reconnects after ``retry_after`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

from tierkv.errors import InvalidInputError
from tierkv.integrations.vllm._vllm import Medium
from tierkv.integrations.vllm.config import Field, VllmTierConfigError
from tierkv.integrations.vllm.source import TierKVSourceTier
from tierkv.integrations.vllm.tier import MAX_WAIT_S
from tierkv.remote.errors import PeerGoneError, RemoteError, RemoteRefusedError, RemoteTimeoutError
from tierkv.remote.protocol.control import split_address
from tierkv.remote.sources.cluster import RemoteCluster

__all__ = ["TierKVPeerTier"]

log = logging.getLogger("tierkv.integrations.vllm")

TRANSPORTS = ("tcp", "shm")


def check_peer_options(tier: str, o: dict[str, Any]) -> tuple[list[str], bytes | None]:
    """The seed addresses and the secret of checked options; raises VllmTierConfigError for
    addresses that are not ``host:port``, neither peers nor a directory, a directory URL that
    does not parse, a secret that is not hex, a transport tierkv does not have. Connects to
    nothing."""
    peers = o["peers"] or []
    if not all(isinstance(p, str) for p in peers):
        raise VllmTierConfigError(f"{tier}: 'peers' must be a list of 'host:port' strings")
    for p in peers:
        try:
            split_address(p)
        except InvalidInputError as exc:
            raise VllmTierConfigError(f"{tier}: 'peers': {exc}") from None
    if not peers and o["directory"] is None:
        raise VllmTierConfigError(f"{tier}: needs 'peers' (host:port list) or a 'directory' URL")
    if o["directory"] is not None:
        from tierkv.remote.membership.redis_directory import check_url

        try:
            check_url(o["directory"])
        except ValueError as exc:
            raise VllmTierConfigError(f"{tier}: 'directory': {exc}") from None
    if o["transport"] not in TRANSPORTS:
        raise VllmTierConfigError(
            f"{tier}: 'transport' must be one of {list(TRANSPORTS)}, got {o['transport']!r}"
        )
    secret = None
    if o["secret"] is not None:
        try:
            secret = bytes.fromhex(o["secret"])
        except ValueError:
            raise VllmTierConfigError(
                f"{tier}: 'secret' must be hex (as tierkv serve --secret)"
            ) from None
        if not secret:
            raise VllmTierConfigError(f"{tier}: 'secret' is empty: an empty secret is not one")
    return list(peers), secret


class TierKVPeerTier(TierKVSourceTier):
    """A vLLM secondary tier on tierkv page servers (peers' host tiers).

    Config::

        {"type": "TierKVPeerTier", "module_path": "tierkv.integrations.vllm",
         "peers": ["10.0.0.7:7600"], "secret": "<hex>"}

    Fields: ``peers`` (``host:port`` list: publishes go to the first that answers; without a
    directory, lookups ask them), ``directory`` (a ``redis://`` URL of the cluster
    directory), one of the two required; ``secret`` (hex, as ``tierkv serve --secret``;
    default ``$TIERKV_TRANSPORT_SECRET``), ``transport`` (``tcp``; ``shm`` on one host),
    ``timeout`` (2.0 s: the bound of every call and transfer), ``retry_after`` (1.0 s: a
    node that failed is left alone that long), ``locality`` (default ``REMOTE``),
    ``drain_timeout``.
    """

    medium: ClassVar[Any] = Medium.CPU if Medium is not None else None
    FIELDS: ClassVar[dict[str, Field]] = {
        "peers": Field((list, type(None)), None),
        "directory": Field((str, type(None)), None),
        "secret": Field((str, type(None)), None),
        "transport": Field((str,), "tcp"),
        "timeout": Field((float,), 2.0, minimum=0.001, maximum=MAX_WAIT_S),
        "retry_after": Field((float,), 1.0, minimum=0.0),
    }

    def __init__(self, *args: Any, **options: Any) -> None:
        options.setdefault("locality", "REMOTE")
        super().__init__(*args, **options)

    def start_deadline(self, o: dict[str, Any]) -> float:
        """The seeds' connects, all at once (each bounded by ``timeout``), then closing on a
        refusal: as long for 20 seeds as for one."""
        return 4 * o["timeout"] * 2 + 1

    def _open(self, o: dict[str, Any]) -> None:
        self._name = f"TierKVPeerTier tier {self.tier_type!r}"
        self._peers, self._secret = check_peer_options(self._name, o)  # before any thread
        self.counters.update(dict.fromkeys(("peer_stored", "peer_loaded", "peer_errors"), 0))
        super()._open(o)

    async def _start(self, o: dict[str, Any]) -> None:
        peers, secret = self._peers, self._secret
        self.cluster = RemoteCluster(
            peers,
            directory=o["directory"],
            transport=o["transport"],
            secret=secret,
            spec=None,  # any page layout of the chunk's size: checked below, per seed
            timeout=o["timeout"],
            retry_after=o["retry_after"],
        )
        try:
            # all at once (one after another, seeds that drop traffic held vLLM's startup
            # for 4 x timeout each), every check ended before anything is closed; the first
            # seed (in their order) refused is the error
            checks = [self._check_seed(self._name, a) for a in dict.fromkeys(peers)]
            got = await asyncio.gather(*checks, return_exceptions=True)
            for failure in got:
                if failure is not None:
                    raise failure
        except BaseException:
            await self.cluster.aclose()
            raise

    async def _check_seed(self, name: str, address: str) -> None:
        """Refuse a seed that refuses us or serves pages of another size; a seed that does
        not answer is only logged."""
        try:
            node = await self.cluster.node(address)
        except RemoteRefusedError as exc:
            raise VllmTierConfigError(
                f"{name}: the page server {address} refused us: {exc}"
            ) from exc
        except (PeerGoneError, RemoteTimeoutError, RemoteError, OSError) as exc:
            log.warning("%s: page server %s does not answer yet: %r", name, address, exc)
            return
        if node.page_bytes != self.block_size_bytes:
            raise VllmTierConfigError(
                f"{name}: the page server {address} serves pages of {node.page_bytes} bytes, "
                f"vLLM's chunks are {self.block_size_bytes} (tierkv serve --layers 1 "
                f"--kv-heads 1 --head-dim {self.block_size_bytes // 2} --dtype fp8 "
                "--page-tokens 1)"
            )

    async def _leading(self, tkeys: list[bytes]) -> int:
        return await self.cluster.lookup(tkeys)

    async def _publish(self, tkeys: list[bytes], slots: list[int]) -> bool:
        """Pages the server holds already are skipped; any error is a failed store."""
        try:
            self.counters["peer_stored"] += await self.cluster.publish(tkeys, self._rows, slots)
        except BaseException:
            self.counters["peer_errors"] += 1
            raise
        return True

    async def _load(self, tkeys: list[bytes], slots: list[int]) -> int:
        try:
            n = await self.cluster.load(tkeys, self._rows, slots)
        except BaseException:
            self.counters["peer_errors"] += 1
            raise
        self.counters["peer_loaded"] += n
        return n

    async def _aclose(self) -> None:
        await self.cluster.aclose()

    def tierkv_stats(self) -> dict[str, Any]:
        """The tier's counters (``peer_stored``: pages newly stored on a server,
        ``peer_loaded``: pages loaded intact, ``peer_errors``: copies a server failed), the
        directory's failed locates and entries it left out (`RedisDirectory.refused_entries`)
        and the pages loaded per node."""
        out: dict[str, Any] = dict(self.counters)
        out["peer_directory_errors"] = self.cluster.directory_errors
        if self.cluster.directory is not None:
            out["peer_directory_refused_entries"] = self.cluster.directory.refused_entries
        out.update({f"peer_loaded_from_{a}": n for a, n in self.cluster.loads_from.items()})
        return out
