"""`RemoteTier`: a peer's host tier, reached through its page server. This file stays whole
(over 400 lines): one class whose calls share the connection, its reconnection and backoff.

::

    async with RemoteTier("10.0.0.7:7600", transport="tcp", secret=s, spec=spec) as peer:
        n = await peer.lookup(page_keys)                   # longest prefix the peer holds
        got = await peer.load(page_keys[:n], arena.array, slots)   # pages -> local slots
        stored = await peer.publish(keys, arena.array, slots)      # local pages -> the peer

`load` pins the pages on the peer for the read (a lease), reads them one-sidedly straight into
the given local slots, then asks the peer whether each page's slot and generation held: pages
from the first one that did not are misses (not counted). Then each page's bytes are checked
against the CRC-32C the peer gave for it (``acquire``): a page that differs, or came without
one, is corrupt (counted in ``corrupt``), and the pages from the first corrupt one on are
misses. `publish` declares its pages' checksums; the peer stores only the pages that match
(CorruptPageError names the others). The caller owns the local slots (for
example reserved WRITING in its page table) and keeps only the counted ones; on any error no
other local memory has been touched and no byte lands after the call returns.

Every wait is bounded by ``timeout``. A cancelled call leaves the connection as it was (its
late reply is dropped by request id); a call that times out, or a connection that breaks (the
server restarted, a malformed or forged frame), is followed by a reconnect on the next call,
with backoff (``retry_after`` doubling up to ``max_backoff`` while the server stays away;
calls in between raise PeerGoneError at once); so is a data transport whose link to the server
broke (over shm, the server revokes an expired writer's link: docs/security.md, *Fenced
writes*). Every malformed reply raises a RemoteError. The file stays whole (~400 lines): one
class whose calls share the connection, the data transport and the reconnect state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any

import numpy as np
import numpy.typing as npt

import tierkv.transports as transports
from tierkv import page_sums, validate
from tierkv.errors import CorruptPageError, InvalidInputError, SpecError
from tierkv.page_sums import NO_SUM, PageCheck, row_sums
from tierkv.remote.errors import (
    LeaseExpiredError,
    PeerGoneError,
    RemoteError,
    RemoteProtocolError,
    RemoteRefusedError,
    map_transport_error,
)
from tierkv.remote.protocol.control import Control, split_address
from tierkv.remote.protocol.exposure import resolve_secret
from tierkv.remote.protocol.wire import lease_ttl_of, spec_fields
from tierkv.remote.sources.watch import Watch
from tierkv.spec import KVSpec
from tierkv.tenant_names import check_tenant

__all__ = ["ReadLease", "RemoteTier"]

Slots = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Pages pinned on the peer for one read: their keys, peer slots and generations."""

    lease: int
    keys: list[bytes]
    slots: list[int]
    gens: list[int]
    sums: list[int] | None = None  # the pages' checksums (None: the peer sent none)


def _ints(value: Any, low: int | None) -> bool:
    """``value`` is a list of ints, each >= ``low`` (when given)."""
    if not isinstance(value, list):
        return False
    return all(type(v) is int and (low is None or v >= low) for v in value)


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local slot, remote slot, count) runs where both sides are consecutive."""
    out: list[tuple[int, int, int]] = []
    for lo, ro in zip(local, remote):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((lo, ro, 1))
    return out


class RemoteTier:
    """A client of one page server. Use as ``async with`` (or `connect` / `aclose`).

    Args:
        address: ``host:port`` of the page server's control socket.
        transport: the data transport to use (one the server offers: ``shm``, ``tcp``...).
        secret: shared secret (default ``$TIERKV_TRANSPORT_SECRET``); with ``tenant``, that
            tenant's secret.
        tenant: the tenant we are (docs/security.md, *Tenants*): the server proves us against
            its secret, and we read and publish only its pages. None: no tenant.
        spec: our page layout; `connect` refuses a server whose layout differs.
        timeout: bound of every control reply, connect and transfer, in seconds.
        transport_options: extra keyword arguments for the local transport.
        retry_after / max_backoff: the first and the longest wait before reconnecting after
            the connection broke.
        ssl: a client TLS context for the control connection (docs/security.md); the data
            transport takes its own (``transport_options={"ssl_client": ctx}`` for tcp).
    """

    def __init__(
        self,
        address: str,
        *,
        transport: str = "tcp",
        secret: bytes | None = None,
        spec: KVSpec | None = None,
        timeout: float = 10.0,
        transport_options: dict[str, Any] | None = None,
        retry_after: float = 0.05,
        max_backoff: float = 2.0,
        ssl: SSLContext | None = None,
        tenant: str | None = None,
    ) -> None:
        timeout = validate.seconds("timeout", timeout)  # (NaN: every wait unbounded)
        if spec is not None:
            validate.spec(spec)
        retry_after = validate.seconds("retry_after", retry_after, allow_zero=True)
        max_backoff = validate.seconds("max_backoff", max_backoff, allow_zero=True)
        self.ssl = ssl
        self.tenant = None if tenant is None else check_tenant(tenant)
        self.host, self.port = split_address(address)
        self.retry_after, self.max_backoff = retry_after, max_backoff
        self._backoff = retry_after
        self._retry_at = 0.0
        self._opened = False  # connect() succeeded once and aclose() has not run since
        self._reconnecting: asyncio.Lock | None = None
        self._connecting: asyncio.Lock | None = None  # (one connect at a time)
        self.reconnects = 0
        self.kind = transport
        self.secret = resolve_secret(secret, insecure=True)  # none: only insecure servers admit us
        self.spec, self.timeout = spec, timeout
        self._options = transport_options or {}
        self.page_bytes = 0
        self.lease_ttl = 0.0
        self.server_name = ""
        self._ctl: Control | None = None
        self._transport: transports.Transport | None = None
        self._link_lost = False  # our data transport lost the server: reconnect both
        self._region: transports.RegionDescriptor | None = None
        self.corrupt = 0  # pages read that failed their checksum (misses, never delivered)
        self.corrupt_published = 0  # pages we published that the peer refused as corrupt

    #: `load` verifies pages and reports their checksums (tierkv.page_source.load_checked)
    checks_pages = True
    #: the label of its corrupt pages in a store's counters
    tier_label = "peer"

    # -- life cycle ----------------------------------------------------------------------
    async def connect(self) -> RemoteTier:
        """Connect, authenticate, check the page layout, reach the data transport.

        Raises PeerGoneError (unreachable), RemoteTimeoutError, RemoteRefusedError (bad
        secret, other layout, transport not offered; TenantRefusedError: our tenant unknown
        to the server or not our secret's), RemoteProtocolError. Connected already: returns
        at once (a second connection replaced the first without closing it); calls made while
        one connects wait for it and share its connection.
        """
        if self._opened:
            return self
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # (concurrent connects each made a connection: all but
            if self._opened:  # the last one leaked, their reader tasks left pending)
                return self
            try:
                await self._connect()
            except BaseException:
                await self.aclose()
                raise
            self._opened = True
        return self

    async def _connect(self) -> None:
        self._ctl = Control(
            f"{self.host}:{self.port}",
            secret=self.secret,
            timeout=self.timeout,
            ssl=self.ssl,
            tenant=self.tenant,
        )
        hello = await self._ctl.open()
        spec = hello.get("spec")
        if not isinstance(spec, dict) or type(spec.get("page_bytes")) is not int:
            raise RemoteProtocolError("the page server's hello has no page layout")
        if spec["page_bytes"] <= 0:
            raise RemoteProtocolError(f"page_bytes {spec['page_bytes']} in the hello")
        if self.spec is not None and spec != spec_fields(self.spec):
            raise RemoteRefusedError(f"page layout differs: ours {spec_fields(self.spec)}, {spec}")
        ttl = lease_ttl_of(hello)
        name = hello.get("name", "")
        if not isinstance(name, str):
            raise RemoteProtocolError(f"the hello's name is a {type(name).__name__}, not a str")
        self.page_bytes = spec["page_bytes"]
        self.lease_ttl = ttl
        self.server_name = name[:256]
        offered = hello.get("transports")
        if not isinstance(offered, dict) or not isinstance(offered.get(self.kind), dict):
            names = sorted(map(str, offered)) if isinstance(offered, dict) else []
            raise RemoteRefusedError(f"the page server offers {names}, not {self.kind!r}")
        info = offered[self.kind]
        if not isinstance(info.get("region"), bytes) or not isinstance(info.get("metadata"), bytes):
            raise RemoteProtocolError(f"the hello's {self.kind} entry lacks region or metadata")
        opts: dict[str, Any] = {"timeout": self.timeout, **self._options}
        if self.kind in ("tcp", "shm"):
            opts.setdefault("secret", self.secret)
        try:
            self._region = transports.RegionDescriptor.unpack(info.get("region", b""))
            self._transport = transports.create(self.kind, **opts)
            await self._transport.start()
            await self._transport.add_peer(info.get("metadata", b""))
        except transports.TransportError as exc:
            raise map_transport_error(exc, f"reaching the {self.kind} data transport") from exc
        except ValueError as exc:  # a transport option missing (tcp without a secret)
            raise RemoteRefusedError(str(exc)) from exc
        except (TypeError, KeyError, IndexError) as exc:  # a descriptor that is not one
            raise RemoteProtocolError(f"the hello's {self.kind} entry: {exc}") from exc

    async def aclose(self) -> None:
        """Close the control connection and the data transport. Idempotent."""
        self._opened = False
        await self._drop()

    async def _drop(self) -> None:
        ctl, self._ctl = self._ctl, None
        if ctl is not None:
            await ctl.aclose()
        if self._transport is not None:
            await self._transport.aclose()
            self._transport = None

    async def __aenter__(self) -> RemoteTier:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- control calls -------------------------------------------------------------------
    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        ctl = self._ctl
        if ctl is None or not ctl.connected or self._link_lost:
            ctl = await self._reconnect()
        return await ctl.call(op, **fields)

    async def _reconnect(self) -> Control:
        """A fresh connection after the last one broke (bounded by the backoff). Raises
        PeerGoneError (closed, or too soon), or what `connect` raises."""
        if not self._opened:
            raise PeerGoneError("not connected to the page server (closed)")
        if self._reconnecting is None:
            self._reconnecting = asyncio.Lock()
        async with self._reconnecting:
            if self._ctl is not None and self._ctl.connected and not self._link_lost:
                return self._ctl  # another call reconnected meanwhile
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                raise PeerGoneError(f"{self.host}:{self.port} broke; reconnecting in {wait:.2f} s")
            await self._drop()
            try:
                await self._connect()
            except BaseException:
                await self._drop()
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self.max_backoff)
                raise
            self._backoff = self.retry_after
            self._link_lost = False
            self.reconnects += 1
            assert self._ctl is not None
            return self._ctl

    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` the peer holds (readable, in its host tier)."""
        n = (await self._call("lookup", keys=list(keys))).get("n")
        if type(n) is not int or not 0 <= n <= len(keys):
            raise RemoteProtocolError(f"bad lookup answer {n!r}")
        return n

    async def locate(self, keys: list[bytes]) -> list[str]:
        """For the leading pages of ``keys`` that any node of the server's cluster holds, the
        address (``host:port``) of one holding it; shorter than ``keys`` from the first page
        no node holds. A hint (the directory lags by up to the servers' sync interval)."""
        nodes = (await self._call("locate", keys=list(keys))).get("nodes")
        if not isinstance(nodes, list) or len(nodes) > len(keys):
            raise RemoteProtocolError("bad locate answer")
        if not all(isinstance(n, str) for n in nodes):
            raise RemoteProtocolError("bad locate answer")
        for n in dict.fromkeys(nodes):  # (each is an address a cluster connects to next)
            try:
                split_address(n)
            except InvalidInputError:
                raise RemoteProtocolError(f"bad locate answer: node {n!r:.80}") from None
        return nodes

    async def watch(
        self,
        keys: list[bytes] | None = None,
        *,
        callback: Callable[[list[bytes]], None] | None = None,
        max_batches: int = 256,
    ) -> Watch:
        """Watch pages on this server: a `Watch` (on a connection of its own) yields batches
        of watched keys that left the server's host tier. ``aclose`` it when done. Raises
        PeerGoneError, RemoteTimeoutError, RemoteRefusedError."""
        w = Watch(
            f"{self.host}:{self.port}",
            secret=self.secret,
            timeout=self.timeout,
            callback=callback,
            max_batches=max_batches,
            ssl=self.ssl,
            tenant=self.tenant,
        )
        await w.start()
        try:
            if keys:
                await w.add(list(keys))
        except BaseException:
            await w.aclose()
            raise
        return w

    async def stats(self) -> dict[str, Any]:
        """The page server's figures (pages served, leases, expiries)."""
        return await self._call("stats")

    # -- reads ---------------------------------------------------------------------------
    async def acquire(self, keys: list[bytes]) -> ReadLease:
        """Pin the leading pages of ``keys`` that the peer holds; release with `release`."""
        reply = await self._call("acquire", keys=list(keys))
        slots, gens, lease = reply.get("slots"), reply.get("gens"), reply.get("lease")
        sums = reply.get("sums")
        if not (_ints(slots, 0) and _ints(gens, None) and type(lease) is int):
            raise RemoteProtocolError("bad acquire answer")
        assert isinstance(slots, list) and isinstance(gens, list)
        if len(slots) != len(gens) or len(slots) > len(keys):
            raise RemoteProtocolError("bad acquire answer")
        if sums is not None and not (_ints(sums, NO_SUM) and len(sums) == len(slots)):
            raise RemoteProtocolError("bad acquire answer (sums)")
        return ReadLease(lease, list(keys[: len(slots)]), slots, gens, sums)

    async def read(self, lease: ReadLease, array: Slots, slots: list[int]) -> None:
        """Copy the lease's pages into ``slots`` of ``array`` ([num_slots, page_bytes] uint8).

        Raises PeerGoneError, RemoteTimeoutError, RemoteError; no byte lands after it returns.
        """
        await self._transfer("read", array, slots, lease.slots)

    async def _read(self, lease: ReadLease, array: Slots, slots: list[int]) -> list[int] | None:
        """`read`, page by page with each page's CRC-32C taken as it lands (a transport that
        copies takes it right after the copy, the bytes still in cache): the checksums, or
        None with page checksums off."""
        if not page_sums.enabled():
            await self._transfer("read", array, slots, lease.slots)
            return None
        return await self._transfer("read", array, slots, lease.slots, checksums=True)

    async def release(self, lease: ReadLease) -> int:
        """End a read lease; returns how many leading pages were still valid when it ended."""
        valid = (await self._call("release", lease=lease.lease)).get("valid")
        if type(valid) is not int or not 0 <= valid <= len(lease.keys):
            raise RemoteProtocolError(f"bad release answer {valid!r}")
        return valid

    async def load(
        self, keys: list[bytes], array: Slots, slots: list[int], check: PageCheck | None = None
    ) -> int:
        """Read the leading pages of ``keys`` the peer holds into ``slots`` of ``array``.

        Returns how many leading pages arrived intact (the rest are misses: not held, evicted
        and reused on the peer during the read, or corrupt: bytes that differ from the
        checksum the peer gave, counted in ``corrupt``). ``check``, when given, receives the
        delivered pages' checksums and the corrupt count. Raises PeerGoneError,
        RemoteTimeoutError, RemoteError, SpecError; only ``slots`` may have been written then.
        """
        if len(slots) < len(keys):
            raise SpecError(f"{len(slots)} local slots for {len(keys)} pages")
        lease = await self.acquire(keys)
        local = list(slots[: len(lease.slots)])
        landed: list[int] | None = None
        if lease.slots:
            try:
                landed = await self._read(lease, array, local)
            except BaseException:
                with contextlib.suppress(RemoteError):  # the lease also ends on its own
                    await self.release(lease)
                raise
        valid = await self.release(lease)
        return self._verified(lease, array, local[:valid], check, landed)

    def _verified(
        self,
        lease: ReadLease,
        array: Slots,
        local: list[int],
        check: PageCheck | None,
        landed: list[int] | None,
    ) -> int:
        """How many leading pages of ``local`` (read under ``lease``; ``landed``: their
        checksums as they landed) match the checksums the peer gave; the ones that do not are
        counted."""
        if not local or not page_sums.enabled():
            return len(local)
        got = landed if landed is not None and len(landed) >= len(local) else None
        if got is None:
            got = row_sums(array, local)
        want = lease.sums or [NO_SUM] * len(local)
        bad = [i for i, (w, g) in enumerate(zip(want, got)) if w == NO_SUM or w != g]
        n = bad[0] if bad else len(local)
        self.corrupt += len(bad)
        if check is not None:
            check.corrupt += len(bad)
            check.sums = got[:n]
        return n

    # -- writes --------------------------------------------------------------------------
    async def publish(
        self,
        keys: list[bytes],
        array: Slots,
        slots: list[int],
        sums: list[int] | None = None,
    ) -> int:
        """Write the pages in ``slots`` of ``array`` to the peer's host tier under ``keys``.

        ``sums``: the pages' checksums (from the page table; by default computed from the
        bytes in ``array`` now). Pages the peer already holds are skipped. Returns the pages
        newly stored. Raises CorruptPageError when the peer refused pages whose bytes did not
        match their checksum (``stored`` says how many others it stored), RemoteFullError (no
        room on the peer), LeaseExpiredError (the reservation expired first: nothing stored),
        PeerGoneError, RemoteTimeoutError, RemoteError.
        """
        if len(slots) != len(keys):
            raise SpecError(f"{len(slots)} local slots for {len(keys)} pages")
        agent = self._transport.name if self._transport is not None else None
        fields: dict[str, Any] = {"keys": list(keys), "agent": agent}
        if page_sums.enabled():
            if sums is None or len(sums) != len(keys):
                sums = row_sums(array, slots) if keys else []
            fields["sums"] = list(sums)
        reply = await self._call("reserve", **fields)
        lease, remote = reply.get("lease"), reply.get("slots")
        if type(lease) is not int or not _ints(remote, -1):
            raise RemoteProtocolError("bad reserve answer")
        assert isinstance(remote, list)
        if len(remote) != len(keys):
            raise RemoteProtocolError("bad reserve answer")
        todo = [(lo, ro) for lo, ro in zip(slots, remote) if ro >= 0]
        try:
            if todo:
                await self._transfer("write", array, [lo for lo, _ in todo], [ro for _, ro in todo])
        except BaseException as exc:
            ctl = self._ctl  # the lease's connection, never a new one (it would not know it)
            if ctl is not None and ctl.connected:
                try:
                    await ctl.call("commit", lease=lease, ok=False)
                except LeaseExpiredError as expired:  # why the write was refused
                    if isinstance(exc, RemoteError):
                        raise expired from exc
                except RemoteError:
                    pass
            raise
        done = await self._call("commit", lease=lease, ok=True)
        stored, corrupt = done.get("stored"), done.get("corrupt", 0)
        if type(stored) is not int or not 0 <= stored <= len(keys):
            raise RemoteProtocolError("bad commit answer")
        if type(corrupt) is not int or not 0 <= corrupt <= len(keys) - stored:
            raise RemoteProtocolError("bad commit answer (corrupt)")
        if corrupt:
            self.corrupt_published += corrupt
            raise CorruptPageError(
                f"the page server refused {corrupt} of {len(keys)} pages: their bytes did not "
                f"match their checksums ({stored} stored)",
                tier="peer",
                pages=corrupt,
                stored=stored,
            )
        return stored

    # -- one-sided transfers -------------------------------------------------------------
    async def _transfer(
        self,
        direction: str,
        array: Slots,
        local: list[int],
        remote: list[int],
        *,
        checksums: bool = False,
    ) -> list[int] | None:
        """One-sided ``direction`` of pages; with ``checksums`` (reads), one op per page and
        the CRC-32C of each as it landed (returned)."""
        t, desc, pb = self._transport, self._region, self.page_bytes
        if t is None or desc is None:
            raise PeerGoneError("not connected to the page server")
        if array.ndim != 2 or array.shape[1] != pb or array.dtype != np.uint8:
            raise SpecError(f"local pages must be a uint8 array [n, {pb}], got {array.shape}")
        if any(not 0 <= s < array.shape[0] for s in local):
            raise SpecError(f"a local slot is outside [0, {array.shape[0]})")
        try:
            region = t.register_memory(array)
        except transports.TransportError as exc:
            raise map_transport_error(exc, "registering the local pages") from exc
        handle: transports.BatchHandle | None = None
        try:
            runs = [(lo, ro, 1) for lo, ro in zip(local, remote)] if checksums else None
            ops = [
                transports.TransferOp(region, lo * pb, desc, ro * pb, n * pb)
                for lo, ro, n in (runs or _runs(local, remote))
            ]
            handle = t.read(ops, checksums=checksums) if direction == "read" else t.write(ops)
            await handle.wait(self.timeout)
            return handle.sums
        except transports.TransportError as exc:
            self._link_lost |= isinstance(exc, transports.PeerError)  # revoked, or gone
            raise map_transport_error(exc, f"{direction} of {len(local)} pages") from exc
        finally:
            if handle is not None:
                handle.cancel()  # no-op when done; else no byte lands after this
            t.deregister(region)
