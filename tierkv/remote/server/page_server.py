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
"""

from __future__ import annotations

import asyncio
from ssl import SSLContext
from typing import TYPE_CHECKING, Any

from tierkv.errors import InvalidInputError, TierKVError
from tierkv.remote.errors import (
    LeaseExpiredError,
    RemoteError,
    RemoteFullError,
)
from tierkv.remote.protocol.exposure import is_loopback, resolve_secret
from tierkv.remote.protocol.wire import agent_of, int_of, keys_of, spec_fields, sums_of
from tierkv.remote.server.control_socket import ControlSocket
from tierkv.remote.server.directory import Directory, is_content
from tierkv.remote.server.hosting import SharedArena, register_host_arena, share_host_arena
from tierkv.remote.server.watches import WatchHub
from tierkv.store import KVStore
from tierkv.transports import Transport, TransportError, create
from tierkv.transports.fence import WriteGuard
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
            ``$TIERKV_TRANSPORT_SECRET``. Empty: ValueError.
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

    Raises ValueError (no secret, empty secret, insecure off loopback), DirectoryURLError (a
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
        self.ssl = ssl
        self.store = store
        self.kinds = sorted(dict.fromkeys(transports), key=lambda k: k != "shm")
        self.host, self.port = host, port
        self.secret = resolve_secret(secret, insecure=insecure)
        if not self.secret and not is_loopback(host):
            raise InvalidInputError(
                f"without a secret the page server stays on loopback, not {host!r}"
            )
        self.lease_ttl, self.timeout, self.max_writing = lease_ttl, timeout, max_writing
        self._options = transport_options or {}
        self.transports: dict[str, Transport] = {}
        self.shared: dict[str, SharedArena] = {}
        self.directory: Directory | None = None
        self._advertise = advertise
        self.watches = WatchHub(max_pending=watch_pending, timeout=timeout)
        if isinstance(directory, str):
            from tierkv.remote.membership.redis_directory import RedisDirectory

            directory = RedisDirectory(directory, ttl=directory_ttl)
        self._redis_directory = directory
        self.agent: DirectoryAgent | None = None
        self.audit = Audit("page-server")
        self.gate = Gate(
            per_peer=max_conns_per_peer,
            preauth_per_peer=max_preauth_per_peer,
            preauth_total=max_preauth,
            failures=max_preauth_failures,
        )
        self.control = ControlSocket(
            secret=self.secret,
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
        RemoteError (a transport failed, the arena cannot be shared, the port is taken)."""
        try:
            for i, kind in enumerate(self.kinds):
                opts: dict[str, Any] = {"timeout": self.timeout, **self._options.get(kind, {})}
                if kind in ("tcp", "shm"):
                    opts.setdefault("secret", self.secret)
                if kind == "tcp":
                    opts.setdefault("host", self.host)
                t = create(kind, **opts)
                self.transports[kind] = t
                await t.start()
                share = share_host_arena if i == 0 else register_host_arena
                self.shared[kind] = share(self.store, t)
                t.guard_writes(self._guard(self.shared[kind].region.region_id))
            self.directory = Directory(
                self.store.tiers,
                lease_ttl=self.lease_ttl,
                revoke=self._revoke,
                max_writing=self.max_writing,
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
        for t in self.transports.values():
            await t.aclose()
        self.transports.clear()
        if self.directory is not None:
            self.directory.unfence_all()  # the transports are closed: nothing lands any more
        for shared in self.shared.values():
            shared.close()

    async def __aenter__(self) -> PageServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _hello(self) -> dict[str, Any]:
        return {
            "name": next(iter(self.transports.values())).name,
            "spec": spec_fields(self.store.spec),
            "lease_ttl": self.lease_ttl,
            "checks": "crc32c",  # page checksums (wire.py)
            "transports": {
                kind: {"metadata": t.metadata(), "region": _packed(self.shared[kind])}
                for kind, t in self.transports.items()
            },
        }

    def _answer(
        self, msg: dict[str, Any], owner: object, session: StreamSession, addr: str
    ) -> dict[str, Any]:
        d = self.directory
        assert d is not None
        op = msg.get("op")
        try:
            if op == "lookup":
                return {"n": d.lookup(keys_of(msg))}
            if op == "acquire":
                lease, slots, gens, sums = d.acquire(keys_of(msg), owner)
                reply = {"lease": lease, "slots": slots, "gens": gens}
                if len(sums) == len(slots):  # (none with checksums off: measurements only)
                    reply["sums"] = sums
                return reply
            if op == "release":
                return {"valid": d.release(int_of(msg, "lease"), owner)}
            if op == "reserve":
                keys = keys_of(msg)
                lease, slots = d.reserve(keys, owner, sums_of(msg, len(keys)), agent_of(msg))
                return {"lease": lease, "slots": slots}
            if op == "commit":
                lease, ok = int_of(msg, "lease"), bool(msg.get("ok"))
                # the peer's bytes, before they are served (its commit says its writes ended)
                corrupt = d.verify(lease, owner) if ok else 0
                stored = d.commit(lease, ok, owner)
                if stored and self.agent is not None:
                    self.agent.changed()  # the directory hears of published pages at once
                return {"stored": stored, "corrupt": corrupt}
            if op == "locate":
                return {"nodes": self.locate(keys_of(msg))}
            if op == "watch":
                return {"held": self.watches.watch(owner, session, keys_of(msg), self._holds)}
            if op == "unwatch":
                self.watches.unwatch(owner, keys_of(msg))
                return {}
            if op == "hello":
                return self._hello()
            if op == "stats":
                return self.stats()
        except RemoteFullError as exc:
            return {"err": "full", "msg": str(exc)}
        except LeaseExpiredError as exc:
            return {"err": "expired", "msg": str(exc)}
        except TierKVError as exc:  # a malformed request, or one the page table refused
            return {"err": "bad", "msg": f"{type(exc).__name__}: {exc}"}
        return {"err": "op", "msg": f"unknown op {op!r}"}

    def stats(self) -> dict[str, Any]:
        """Pages served (readable content pages in the host tier), leases, expiries, peers,
        watchers, and the security counters (``*_total``, ours and each transport's)."""
        d = self.directory
        assert d is not None
        table = self.store.tiers.table
        return {
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

    def _transport_security(self) -> dict[str, int]:
        """The data transports' security counters (``<kind>_<event>_total``)."""
        out: dict[str, int] = {}
        for kind, t in self.transports.items():
            audit = getattr(t, "audit", None)
            if isinstance(audit, Audit):
                out.update({f"{kind}_{k}": v for k, v in audit.stats().items()})
            out[f"{kind}_notifications_dropped_total"] = t.notifications_dropped
        return out

    # -- fencing peers' writes (directory.py, transports/fence.py) -------------------------
    def _guard(self, region_id: int) -> WriteGuard:
        """The write guard of one transport: a peer's write must fall in our host arena's
        region, in slots of a live write lease its agent may write."""
        slot_bytes = self.store.tiers.glue.host_arena.slot_bytes

        def may_write(agent: str, rid: int, offset: int, length: int) -> bool:
            d = self.directory
            if d is None or rid != region_id or length <= 0:
                return False
            return d.may_write(agent, offset // slot_bytes, (offset + length - 1) // slot_bytes)

        return may_write

    def _revoke(self, agent: str | None) -> list[asyncio.Future[None] | None]:
        """Revoke a fenced writer's access on every transport (futures: drained)."""
        return [t.write_fence(agent) for t in self.transports.values()]

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
        if self.agent is not None:
            self.agent.changed()


def _packed(shared: SharedArena) -> bytes:
    return shared.region.descriptor.pack()
