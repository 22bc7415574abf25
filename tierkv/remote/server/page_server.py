"""The page server: a store's host tier, served to peers through one or more transports.

::

    peer (RemoteTier)                         this process
      control: lookup / acquire / release  -> PageServer -> Directory (slots, generations,
               reserve / commit               (asyncio      leases) over store.tiers.table
                                               stream)
      data:    one-sided read / write      -> the host arena, registered with each transport
               (shm: memcpy from the mapped segment; tcp: a batch request to its server)

Only content pages (shareable, immutable) that are readable in the host tier are served. A
connection that closes drops its leases (pins released, generations bumped) and its watches.

With a ``directory`` (Redis / Valkey: tierkv.remote.membership), the server registers there
and keeps what its host tier holds published, so that a `RemoteCluster` finds which node holds
which page; without one it answers for its own pages only. A client may `watch` pages to hear
when they leave this host tier (watches.py).

Hostile peers (docs/security.md): the accept loop (tierkv.transports.acceptor) judges each new
connection by its address before anything is read or allocated for it (connections and
unauthenticated ones per address, unauthenticated ones in total, a penalty for an address
whose handshakes keep failing); refused ones are held unread, then reset. An admitted
connection runs the mutual handshake of `transports.session` (a hello of at most 4 KiB within
a deadline), then every frame is tagged and decoded within `REQUEST_LIMITS`. Refused
authentication, protocol errors and budget hits are counted (``stats()``: ``*_total``) and
logged (``tierkv.security``, rate limited).

Tenants (``secrets``: a secret per tenant, besides the default one; tenants.py): a session
proves one tenant's secret in its handshake and from then on names only that tenant's pages
(its keys are mapped to the tenant's: tierkv.remote.protocol.tenancy), so another tenant's
page looks exactly like one nobody holds. Each tenant has data transports of its own (its
secret), whose write guard lets in only that tenant's write leases and whose read guard (tcp)
only slots that tenant holds a read lease on; with tenants the default transports' reads are
guarded too. The file stays whole (~450 lines): one class whose requests, transports and
guards share the directory and the tenants' keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from ssl import SSLContext
from typing import TYPE_CHECKING, Any

from tierkv.errors import InvalidInputError, InvalidTypeError, TierKVError
from tierkv.remote.errors import (
    LeaseExpiredError,
    RemoteError,
    RemoteFullError,
)
from tierkv.remote.protocol.exposure import is_loopback, resolve_secret
from tierkv.remote.protocol.wire import agent_of, int_of, keys_of, spec_fields, sums_of
from tierkv.remote.server.control_socket import ControlSocket, Peer
from tierkv.remote.server.directory import Directory, is_content
from tierkv.remote.server.hosting import SharedArena, register_host_arena, share_host_arena
from tierkv.remote.server.server_args import check_server_args
from tierkv.remote.server.tenants import ServerTenants
from tierkv.remote.server.watches import WatchHub
from tierkv.store import KVStore
from tierkv.transports import Transport, TransportError, create
from tierkv.transports.fence import ReadGuard, WriteGuard
from tierkv.transports.guard import Audit, Gate
from tierkv.transports.session import HELLO_DEADLINE, StreamSession

if TYPE_CHECKING:  # the directory needs the `redis` extra: imported when one is given
    from tierkv.remote.membership.agent import DirectoryAgent
    from tierkv.remote.membership.redis_directory import RedisDirectory

__all__ = ["PageServer"]


class PageServer:
    """Serve ``store``'s host tier: a control socket on ``host:port`` and data transports.

    Args:
        store: an opened store whose host tier holds no page yet (its arena is rebound onto
            shareable memory).
        transports: transport names; shm (if named) goes first, as it needs the arena in a
            segment of its own.
        secret: shared secret of the control socket and of the transports (tcp, shm); default
            ``$TIERKV_TRANSPORT_SECRET``. Empty: ValueError. With ``secrets``, the secret of
            sessions that name no tenant (their pages are nobody's but theirs too).
        secrets: a secret per tenant (``{"acme": b"...", ...}``): a client that names a
            tenant proves its secret and reads and publishes only its pages (docs/security.md,
            *Tenants*). None: no tenants. With a store of tenants (``KVStore(tenants=)``) each
            must be one of the store's: the pages its sessions publish are charged to it and
            its quotas decide their room (a reserve past them answers "full").
        insecure: serve without a secret (anyone who can connect may use the server); only
            on a loopback ``host`` (else ValueError).
        lease_ttl: seconds a peer may hold pages pinned (reads) or slots reserved (writes). A
            write lease that expires is fenced (directory.py): its slots stay quarantined
            until its write has ended for certain, and its late commit raises
            LeaseExpiredError to the writer.
        max_writing: host slots that write leases and the quarantine may hold together
            (default: the whole host tier); past it, reserve answers "full".
        timeout: bound of the transports' transfers and of a client's hello.
        transport_options: extra keyword arguments per transport name.
        directory: the cluster directory to register in and publish our pages to: a URL
            (``redis://[:password@]host:port/db``, ``rediss://`` for TLS) or a
            `RedisDirectory`. None: no directory (clients find our pages by asking us).
        directory_ttl: seconds our registration lives without a refresh (with a URL).
        advertise: our address as clients reach it, and our node id in the directory
            (default: ``host:port`` once bound).
        watch_pending: departed keys a watcher may have queued before it is dropped.
        max_conns_per_peer / max_preauth_per_peer: open connections per peer address (all /
            not yet authenticated); past them a connection is refused (a budget hit).
        max_preauth: connections not yet authenticated, from all addresses together.
        max_preauth_failures: failed handshakes (bad proof, malformed hello, deadline) an
            address may have at once; past them its new connections are refused until they
            are forgiven (one per second). None: no penalty.
        refused_hold / max_refused_held: a refused connection is held unread this many
            seconds (default: the hello deadline) before it is reset, at most this many at
            once (past that, reset at once): a flooding client that waits for an answer
            then reconnects that much slower.
        ssl: TLS context of the control socket (server side); docs/security.md.

    Raises InvalidTypeError / InvalidInputError (server_args.py: a number that is not finite
    and positive, a ``lease_ttl`` over a day, a port outside [0, 65535], no transport named),
    ValueError (no secret, empty secret, insecure off loopback, a tenant secret empty
    or shared, tenants with a transport that proves no secret), TenantError (a bad tenant
    name), UnknownTenantError (a tenant the store's tenants lack), DirectoryURLError (a
    directory URL that does not parse); from `start`: RemoteError when the arena cannot be
    shared or a transport fails, DirectoryAuthError (the directory refused our credentials),
    NodeIdTakenError (another live node registered our address).
    """

    def __init__(
        self,
        store: KVStore,
        *,
        transports: tuple[str, ...] | list[str] = ("tcp",),
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        secrets: Mapping[str, bytes] | None = None,
        insecure: bool = False,
        lease_ttl: float = 10.0,
        max_writing: int | None = None,
        timeout: float = 10.0,
        transport_options: dict[str, dict[str, Any]] | None = None,
        directory: str | RedisDirectory | None = None,
        directory_ttl: float = 5.0,
        advertise: str | None = None,
        watch_pending: int = 1 << 16,
        max_conns_per_peer: int = 256,
        max_preauth_per_peer: int = 32,
        max_preauth: int = 1024,
        max_preauth_failures: int | None = 64,
        refused_hold: float | None = None,
        max_refused_held: int = 256,
        ssl: SSLContext | None = None,
    ) -> None:
        if not isinstance(store, KVStore):  # (a SyncKVStore was an AttributeError)
            raise InvalidTypeError(f"store must be a KVStore, got {type(store).__name__}")
        check_server_args(
            transports,
            port,
            {"lease_ttl": lease_ttl, "timeout": timeout, "directory_ttl": directory_ttl},
            {
                "max_writing": max_writing,
                "watch_pending": watch_pending,
                "max_conns_per_peer": max_conns_per_peer,
                "max_preauth_per_peer": max_preauth_per_peer,
                "max_preauth": max_preauth,
                "max_preauth_failures": max_preauth_failures,
                "max_refused_held": max_refused_held,
            },
            refused_hold,
        )
        self.ssl = ssl
        self.store = store
        self.kinds = sorted(dict.fromkeys(transports), key=lambda k: k != "shm")
        self.host, self.port = host, port
        self.secret = resolve_secret(secret, insecure=insecure)
        if not self.secret and not is_loopback(host):
            raise InvalidInputError(
                f"without a secret the page server stays on loopback, not {host!r}"
            )
        self.tenants = ServerTenants(secrets, self.secret)
        quotas = store.tenants
        if quotas is not None:  # a session's tenant is charged for what it publishes
            for name in self.tenants.secrets:
                quotas.tenant(name)  # (UnknownTenantError: a secret for no tenant of the store)
        if self.tenants and not set(self.kinds) <= {"tcp", "shm"}:
            raise InvalidInputError(
                f"tenants need data transports that prove a secret (tcp, shm), not {self.kinds}"
            )
        self._tenanted: dict[tuple[str, str], tuple[Transport, SharedArena | None]] = {}
        self.lease_ttl, self.timeout, self.max_writing = lease_ttl, timeout, max_writing
        self._options = transport_options or {}
        self.transports: dict[str, Transport] = {}
        self.shared: dict[str, SharedArena] = {}
        self.directory: Directory | None = None
        self._advertise = _checked_address(advertise)
        self.watches = WatchHub(max_pending=watch_pending, timeout=timeout)
        if isinstance(directory, str):
            from tierkv.remote.membership.redis_directory import RedisDirectory

            directory = RedisDirectory(directory, ttl=directory_ttl)
        self._redis_directory = directory
        self.agent: DirectoryAgent | None = None
        self._started = False
        self.audit = Audit("page-server")
        self.gate = Gate(
            per_peer=max_conns_per_peer,
            preauth_per_peer=max_preauth_per_peer,
            preauth_total=max_preauth,
            failures=max_preauth_failures,
        )
        self.control = ControlSocket(
            secret=self.tenants.secret_of if self.tenants else self.secret,
            tenant_of=self.tenants.tenant_of,
            ident=lambda: self.address,
            answer=self._answer,
            closed=self._closed,
            gate=self.gate,
            audit=self.audit,
            timeout=timeout,
            ssl=ssl,
            hold_s=min(timeout, HELLO_DEADLINE) if refused_hold is None else refused_hold,
            max_held=max_refused_held,
        )

    @property
    def address(self) -> str:
        """Our address as peers and clients reach it (``host:port`` of the control socket,
        unless ``advertise`` says otherwise)."""
        return self._advertise or f"{self.host}:{self.port}"

    async def start(self) -> PageServer:
        """Share the host arena, start the transports and the control socket. Raises
        RemoteError (a transport failed, the arena cannot be shared, the port is taken; a
        server started before: a second start would replace its transports, then close it)."""
        if self._started:
            raise RemoteError("the page server was started already (a server starts once)")
        self._started = True
        try:
            for i, kind in enumerate(self.kinds):
                t = self.transports[kind] = create(kind, **self._transport_options(kind, None))
                await t.start()
                share = share_host_arena if i == 0 else register_host_arena
                self.shared[kind] = share(self.store, t)
                self._protect(t, self.shared[kind], None)
                for tenant in self.tenants.secrets:
                    tt = create(kind, **self._transport_options(kind, tenant))
                    self._tenanted[tenant, kind] = (tt, None)
                    await tt.start()
                    shared = register_host_arena(self.store, tt, like=self.shared[kind])
                    self._tenanted[tenant, kind] = (tt, shared)
                    self._protect(tt, shared, tenant)
            self.directory = Directory(
                self.store.tiers,
                lease_ttl=self.lease_ttl,
                revoke=self._revoke,
                max_writing=self.max_writing,
                guard_reads=bool(self.tenants),
                quotas=self.store.tenants,
            )
            self.port = self.control.start(self.host, self.port)
        except (TransportError, ValueError, OSError) as exc:
            await self.aclose()
            raise RemoteError(f"cannot start the page server: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise
        self.store.tiers.glue.add_host_listener(self._on_left)
        if self._redis_directory is not None:
            from tierkv.remote.membership.agent import DirectoryAgent

            agent = DirectoryAgent(self._redis_directory, self.address, self._held)
            try:
                self.agent = await agent.start()
            except BaseException:
                await agent.aclose()
                await self.aclose()
                raise
        return self

    async def aclose(self) -> None:
        """Stop serving: close connections (their leases end), then the transports."""
        self.control.stop_accepting()
        self.store.tiers.glue.remove_host_listener(self._on_left)
        agent, self.agent = self.agent, None
        if agent is not None:
            await agent.aclose()  # our pages leave every answer now
        self.watches.close_all()
        await self.control.aclose()  # handlers end, their leases with them
        if self.directory is not None:
            self.directory.expire_all()
        for _, _, t in self._all_transports():
            await t.aclose()
        self.transports.clear()
        if self.directory is not None:
            self.directory.unfence_all()  # the transports are closed: nothing lands any more
        for _, shared_t in self._tenanted.values():
            if shared_t is not None:
                shared_t.close()  # (registered the segment below: never unlinks it)
        self._tenanted.clear()
        for shared in self.shared.values():
            shared.close()

    async def __aenter__(self) -> PageServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _transport_options(self, kind: str, tenant: str | None) -> dict[str, Any]:
        """The options of our ``kind`` transport (of ``tenant``: its secret, any port)."""
        opts: dict[str, Any] = {"timeout": self.timeout, **self._options.get(kind, {})}
        if kind in ("tcp", "shm"):
            opts.setdefault("secret", self.secret)
        if kind == "tcp":
            opts.setdefault("host", self.host)
        if tenant is not None:
            opts["secret"] = self.tenants.secrets[tenant]
            opts.pop("name", None)
            opts.pop("port", None)
        return opts

    def _all_transports(self) -> Iterator[tuple[str | None, str, Transport]]:
        """(tenant, kind, transport) of every data transport, the default ones first."""
        for kind, t in self.transports.items():
            yield None, kind, t
        for (tenant, kind), (t, _) in self._tenanted.items():
            yield tenant, kind, t

    def _hello(self, tenant: str | None) -> dict[str, Any]:
        if tenant is None:
            ours = [(kind, t, self.shared[kind]) for kind, t in self.transports.items()]
        else:
            ours = [
                (kind, t, s)
                for (who, kind), (t, s) in self._tenanted.items()
                if who == tenant and s is not None
            ]
        return {
            "name": ours[0][1].name,
            "spec": spec_fields(self.store.spec),
            "lease_ttl": self.lease_ttl,
            "checks": "crc32c",  # page checksums (wire.py)
            "transports": {
                kind: {"metadata": t.metadata(), "region": _packed(s)} for kind, t, s in ours
            },
        }

    def _answer(
        self, msg: dict[str, Any], owner: Peer, session: StreamSession, addr: str
    ) -> dict[str, Any]:
        tenant = owner.tenant
        reply = self._reply(msg, owner, session, tenant)
        if tenant is not None and "err" in reply:
            self.tenants.count(tenant, "refused_total")
        return reply

    def _reply(
        self, msg: dict[str, Any], owner: Peer, session: StreamSession, tenant: str | None
    ) -> dict[str, Any]:
        d = self.directory
        assert d is not None
        op = msg.get("op")
        pb = self.store.spec.page_bytes
        try:
            if op == "lookup":
                return {"n": d.lookup(self.tenants.keys(tenant, keys_of(msg)))}
            if op == "acquire":
                keys = self.tenants.keys(tenant, keys_of(msg))
                lease, slots, gens, sums = d.acquire(keys, owner, tenant)
                self.tenants.count(tenant, "served_pages_total", len(slots))
                self.tenants.count(tenant, "served_bytes_total", len(slots) * pb)
                reply = {"lease": lease, "slots": slots, "gens": gens}
                if len(sums) == len(slots):  # (none with checksums off: measurements only)
                    reply["sums"] = sums
                return reply
            if op == "release":
                return {"valid": d.release(int_of(msg, "lease"), owner)}
            if op == "reserve":
                keys = self.tenants.keys(tenant, keys_of(msg))
                declared = sums_of(msg, len(keys))
                lease, slots = d.reserve(keys, owner, declared, agent_of(msg), tenant)
                return {"lease": lease, "slots": slots}
            if op == "commit":
                lease, ok = int_of(msg, "lease"), bool(msg.get("ok"))
                # the peer's bytes, before they are served (its commit says its writes ended)
                corrupt = d.verify(lease, owner) if ok else 0
                stored = d.commit(lease, ok, owner)
                self.tenants.count(tenant, "published_pages_total", stored)
                self.tenants.count(tenant, "published_bytes_total", stored * pb)
                if stored and self.agent is not None:
                    self.agent.changed()  # the directory hears of published pages at once
                return {"stored": stored, "corrupt": corrupt}
            if op == "locate":
                return {"nodes": self.locate(self.tenants.keys(tenant, keys_of(msg)))}
            if op == "watch":
                names = keys_of(msg)
                keys = self.tenants.keys(tenant, names)
                return {"held": self.watches.watch(owner, session, keys, self._holds, names)}
            if op == "unwatch":
                self.watches.unwatch(owner, self.tenants.keys(tenant, keys_of(msg)))
                return {}
            if op == "hello":
                return self._hello(tenant)
            if op == "stats":
                return self.stats(wire=True) if tenant is None else self.tenant_stats(tenant)
        except RemoteFullError as exc:
            return {"err": "full", "msg": str(exc)}
        except LeaseExpiredError as exc:
            return {"err": "expired", "msg": str(exc)}
        except TierKVError as exc:  # a malformed request, or one the page table refused
            return {"err": "bad", "msg": f"{type(exc).__name__}: {exc}"}
        return {"err": "op", "msg": f"unknown op {op!r}"}

    def stats(self, wire: bool = False) -> dict[str, Any]:
        """Pages served (readable content pages in the host tier), leases, expiries, peers,
        watchers, the security counters (``*_total``, ours and each transport's), and with
        tenants ``tenants``: `tenant_stats` of each (not in the ``stats`` reply, ``wire``:
        a reply's map is bounded)."""
        d = self.directory
        assert d is not None
        table = self.store.tiers.table
        tenants: dict[str, Any] = {}
        if self.tenants:  # claims of tenants nobody configured: together, never by name
            tenants["unknown_tenant_refused_total"] = self.tenants.unknown
            if not wire:
                tenants["tenants"] = self._tenants_stats()
        return {
            **tenants,
            "pages": len(d.entries()),
            "host_used": table.used("host"),
            "corrupt_pages_total": self.store.tiers.stats.corrupt.get("peer", 0),
            "host_capacity": table.capacity("host"),
            "leases": d.leases,
            "expired": d.expired,
            "quarantined": d.quarantined,
            "fenced_total": d.fenced,
            "late_commits_total": d.late_commits,
            "watchers": self.watches.watchers,
            "announced": self.watches.announced,
            "watchers_dropped": self.watches.dropped,
            **(self.agent.stats() if self.agent is not None else {}),
            "sessions": self.control.sessions,
            "refused_held": self.control.held,
            **self.audit.stats(),
            **self._transport_security(),
        }

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """One tenant's figures: its pages in the host tier (``pages``, ``bytes``) and its
        counters (tenants.py); what a session of that tenant is told by ``stats``."""
        assert self.directory is not None
        pages = self.directory.tenant_pages().get(tenant, 0)
        return {
            "tenant": tenant,
            "pages": pages,
            "bytes": pages * self.store.spec.page_bytes,
            **self.tenants.stats(tenant),
        }

    def _tenants_stats(self) -> dict[str, dict[str, Any]]:
        return {t: self.tenant_stats(t) for t in self.tenants.secrets}

    def _transport_security(self) -> dict[str, int]:
        """The data transports' security counters (``<kind>_<event>_total``; a tenant's
        transports count in with the default ones of their kind)."""
        out: dict[str, int] = {}
        for _, kind, t in self._all_transports():
            audit = getattr(t, "audit", None)
            counts = audit.stats() if isinstance(audit, Audit) else {}
            counts["notifications_dropped_total"] = t.notifications_dropped
            for k, v in counts.items():
                out[f"{kind}_{k}"] = out.get(f"{kind}_{k}", 0) + v
        return out

    # -- fencing peers' writes (directory.py, transports/fence.py) -------------------------
    def _protect(self, t: Transport, shared: SharedArena, tenant: str | None) -> None:
        """Guard the writes (and with tenants, the reads) of a transport of ``tenant``."""
        t.guard_writes(self._guard(shared.region.region_id, tenant))
        if self.tenants:
            t.guard_reads(self._read_guard(shared.region.region_id, tenant))

    def _guard(self, region_id: int, tenant: str | None = None) -> WriteGuard:
        """The write guard of one transport (of ``tenant``): a peer's write must fall in our
        host arena's region, in slots of a live write lease of that tenant its agent may
        write."""
        slot_bytes = self.store.tiers.glue.host_arena.slot_bytes

        def may_write(agent: str, rid: int, offset: int, length: int) -> bool:
            d = self.directory
            if d is None or rid != region_id or length <= 0:
                return False
            last = (offset + length - 1) // slot_bytes
            return d.may_write(agent, offset // slot_bytes, last, tenant)

        return may_write

    def _read_guard(self, region_id: int, tenant: str | None) -> ReadGuard:
        """The read guard of one transport of a server with tenants: a peer's read must fall
        in our host arena's region, in slots ``tenant`` holds a live read lease on."""
        slot_bytes = self.store.tiers.glue.host_arena.slot_bytes

        def may_read(agent: str, rid: int, offset: int, length: int) -> bool:
            d = self.directory
            if d is None or rid != region_id or length <= 0:
                return False
            return d.may_read(tenant, offset // slot_bytes, (offset + length - 1) // slot_bytes)

        return may_read

    def _revoke(self, agent: str | None) -> list[asyncio.Future[None] | None]:
        """Revoke a fenced writer's access on every transport (futures: drained)."""
        return [t.write_fence(agent) for _, _, t in self._all_transports()]

    # -- the directory shared with peers, and announcements --------------------------------
    def _closed(self, owner: object) -> None:
        """A control connection ended: its leases and watches go."""
        if self.directory is not None:
            self.directory.expire_all(owner)
        self.watches.close(owner)

    def _holds(self, key: bytes) -> bool:
        tiers = self.store.tiers
        return is_content(key) and bool(tiers.table.lookup([key], tiers.top))

    def _held(self) -> set[bytes]:
        assert self.directory is not None
        return self.directory.held()

    def locate(self, keys: list[bytes]) -> list[str]:
        """Our address for each leading page of ``keys`` that we hold (the cluster's other
        nodes are found through the directory: `RemoteCluster`)."""
        n = 0
        while n < len(keys) and self._holds(keys[n]):
            n += 1
        return [self.address] * n

    def _on_left(self, keys: list[bytes]) -> None:
        """Pages left our host tier: announce them now; the directory hears of it within
        the agent's linger."""
        self.watches.announce(keys)
        if self.directory is not None:
            self.directory.left(keys)
        if self.agent is not None:
            self.agent.changed()


def _packed(shared: SharedArena) -> bytes:
    return shared.region.descriptor.pack()


def _checked_address(advertise: object) -> str | None:
    """``advertise`` if it is ``HOST:PORT`` with a host and a port in [1, 65535] (None stays
    None). Raises InvalidInputError: any text was registered as this node's address."""
    if advertise is None:
        return None
    host, sep, port = advertise.rpartition(":") if isinstance(advertise, str) else ("", "", "")
    if (
        not isinstance(advertise, str)
        or not host
        or not sep
        or not port.isdigit()
        or not 1 <= int(port) <= 65535
    ):
        raise InvalidInputError(
            f"advertise must be HOST:PORT with a host and a port in [1, 65535], got "
            f"{advertise!r:.80}"
        )
    return advertise
