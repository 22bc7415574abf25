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

With ``peers``, servers keep a directory of which node holds which page among themselves
(gossip.py: `locate` answers for every node), and a client may `watch` pages to hear when
they leave this host tier (watch.py).

Hostile peers (docs/security.md): a connection first runs the mutual handshake of
`transports.session` (a hello of at most 4 KiB within a deadline; pre-auth connections capped
per peer address), then every frame is tagged and decoded within `REQUEST_LIMITS`. The server
dials only peers the operator configured, peers that servers we dialled announce, and page
servers that authenticated as such from the address they announce (rate limited); never an
address a client names. Refused authentication, protocol errors and budget hits are counted
(``stats()``: ``*_total``) and logged (``tierkv.security``, rate limited).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from ssl import SSLContext
from typing import Any

from tierkv.errors import TierKVError
from tierkv.remote.directory import Directory, _is_content
from tierkv.remote.errors import RemoteError, RemoteFullError, RemoteProtocolError
from tierkv.remote.exposure import is_loopback, resolve_secret, same_host
from tierkv.remote.gossip import PeerIndex, PeerLink, keys_field
from tierkv.remote.hosting import SharedArena, register_host_arena, share_host_arena
from tierkv.remote.watch import WatchHub
from tierkv.remote.wire import PAGE_SERVER, REQUEST_LIMITS, keys_of
from tierkv.spec import KVSpec
from tierkv.store import KVStore
from tierkv.tiers import HOST
from tierkv.transports import AuthError, ProtocolError, Transport, TransportError, create
from tierkv.transports.guard import (
    AUTH_REFUSED,
    BUDGET_HIT,
    PROTOCOL_ERROR,
    Audit,
    PeerCaps,
    RateLimit,
)
from tierkv.transports.session import HELLO_DEADLINE, StreamSession

__all__ = ["PageServer", "is_loopback", "resolve_secret", "spec_fields"]
#: the control sockets' receive buffer: bounds what one read of a hostile peer's bytes costs
#: (asyncio reads up to 256 KiB at once otherwise); control frames are small
RCVBUF = 1 << 15
DEAD_AFTER = 5  # failed tries after which a learned peer link that never connected is dropped


def spec_fields(spec: KVSpec) -> dict[str, Any]:
    """The page layout a peer must share to use our pages."""
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(spec.dtype),
        "page_tokens": spec.page_tokens,
        "page_bytes": spec.page_bytes,
    }


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
        lease_ttl: seconds a peer may hold pages pinned (reads) or slots reserved (writes).
        timeout: bound of the transports' transfers and of a client's hello.
        transport_options: extra keyword arguments per transport name.
        peers: other page servers (``host:port``) to share the directory with; one seed is
            enough (the others are learned). None / empty: a single node.
        advertise: our address as peers reach it (default: ``host:port`` once bound).
        sync_interval: seconds between directory messages to a peer when nothing changes
            (changes go out within ``sync_linger`` seconds).
        max_peers: the most peer links this server keeps.
        watch_pending: departed keys a watcher may have queued before it is dropped.
        max_conns_per_peer / max_preauth_per_peer: open connections per peer address (all /
            not yet authenticated); past them a connection is closed at once (a budget hit).
        max_preauth: connections not yet authenticated, from all addresses together.
        peer_links_per_minute: new peer links this server may open (beyond the seeds).
        ssl / peer_ssl: TLS contexts of the control socket (server side) and of our links to
            peers (client side); docs/security.md.

    Raises ValueError (no secret, empty secret, insecure off loopback); RemoteError (from
    `start`) when the arena cannot be shared or a transport fails.
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
        timeout: float = 10.0,
        transport_options: dict[str, dict[str, Any]] | None = None,
        peers: list[str] | tuple[str, ...] | None = None,
        advertise: str | None = None,
        sync_interval: float = 1.0,
        sync_linger: float = 0.02,
        max_peers: int = 64,
        watch_pending: int = 1 << 16,
        max_conns_per_peer: int = 256,
        max_preauth_per_peer: int = 32,
        max_preauth: int = 1024,
        peer_links_per_minute: float = 30.0,
        ssl: SSLContext | None = None,
        peer_ssl: SSLContext | None = None,
    ) -> None:
        self.ssl, self.peer_ssl = ssl, peer_ssl
        self.store = store
        self.kinds = sorted(dict.fromkeys(transports), key=lambda k: k != "shm")
        self.host, self.port = host, port
        self.secret = resolve_secret(secret, insecure=insecure)
        if not self.secret and not is_loopback(host):
            raise ValueError(f"without a secret the page server stays on loopback, not {host!r}")
        self.lease_ttl, self.timeout = lease_ttl, timeout
        self._options = transport_options or {}
        self.transports: dict[str, Transport] = {}
        self.shared: dict[str, SharedArena] = {}
        self.directory: Directory | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._sessions: set[StreamSession] = set()
        self.seeds = list(peers or [])
        self._advertise = advertise
        self.sync_interval, self.sync_linger = sync_interval, sync_linger
        self.max_peers = max_peers
        self.index = PeerIndex()
        self.links: dict[str, PeerLink] = {}
        self._configured: set[str] = set()
        self.watches = WatchHub(max_pending=watch_pending, timeout=timeout)
        self._held: set[bytes] = set()
        self._changed: asyncio.Event | None = None
        self._sync: asyncio.Task[None] | None = None
        self.audit = Audit("page-server")
        self.links_refused = 0
        self._conns_per_peer = PeerCaps(max_conns_per_peer)
        self._preauth_per_peer = PeerCaps(max_preauth_per_peer)
        self._preauth_total = PeerCaps(max_preauth)
        self._link_budget = RateLimit(peer_links_per_minute / 60.0, max(1.0, peer_links_per_minute))

    @property
    def address(self) -> str:
        """Our address as peers and clients reach it (``host:port`` of the control socket,
        unless ``advertise`` says otherwise)."""
        return self._advertise or f"{self.host}:{self.port}"

    async def start(self) -> PageServer:
        """Share the host arena, start the transports and the control socket."""
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
        except (TransportError, ValueError) as exc:
            await self.aclose()
            raise RemoteError(f"cannot start the page server: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise
        self.directory = Directory(self.store.tiers, lease_ttl=self.lease_ttl)
        # a small stream buffer: what an unauthenticated peer can make us hold stays small
        self._server = await asyncio.start_server(
            self._on_connect, self.host, self.port, limit=1 << 14, ssl=self.ssl
        )
        self.port = self._server.sockets[0].getsockname()[1]
        for sock in self._server.sockets:  # accepted sockets inherit it: a read takes at most
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # ~this much at once
        self._changed = asyncio.Event()
        self._held = self.directory.held()
        self.store.tiers.host_listeners.append(self._on_left)
        self._sync = asyncio.get_running_loop().create_task(self._sync_loop())
        for peer in self.seeds:
            self.add_peer(peer, configured=True)
        return self

    async def aclose(self) -> None:
        """Stop serving: close connections (their leases end), then the transports."""
        if self._server is not None:
            self._server.close()
        if self._on_left in self.store.tiers.host_listeners:
            self.store.tiers.host_listeners.remove(self._on_left)
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sync
        for link in list(self.links.values()):
            await link.aclose()
        self.links.clear()
        self.watches.close_all()
        for w in list(self._sessions):  # handlers see EOF and end (their leases with them)
            w.close()
        if self._conns:
            await asyncio.wait(self._conns, timeout=self.timeout)
        if self.directory is not None:
            self.directory.expire_all()
        for t in self.transports.values():
            await t.aclose()
        self.transports.clear()
        for shared in self.shared.values():
            shared.close()

    async def __aenter__(self) -> PageServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- connections ---------------------------------------------------------------------
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else addr
        if not self._conns_per_peer.admit(addr):
            self.audit.note(BUDGET_HIT, where, "connections_per_peer")
            writer.close()
            return
        if not self._preauth_total.admit("*"):
            self._conns_per_peer.release(addr)
            self.audit.note(BUDGET_HIT, where, "preauth_total")
            writer.close()
            return
        if not self._preauth_per_peer.admit(addr):
            self._preauth_total.release("*")
            self._conns_per_peer.release(addr)
            self.audit.note(BUDGET_HIT, where, "preauth_per_peer")
            writer.close()
            return
        preauth = True
        session = StreamSession(reader, writer, REQUEST_LIMITS)
        self._conns.add(task)
        self._sessions.add(session)
        owner = object()
        try:
            await session.serve_handshake(
                self.secret, PAGE_SERVER, self.address, deadline=min(self.timeout, HELLO_DEADLINE)
            )
            self._preauth_per_peer.release(addr)
            self._preauth_total.release("*")
            preauth = False
            while (msg := await session.recv()) is not None:
                reply = self._answer(msg, owner, session, addr)
                rid = msg.get("id")
                await asyncio.wait_for(
                    session.send({"id": rid if type(rid) is int else None, **reply}), self.timeout
                )
        except AuthError as exc:
            self.audit.note(
                AUTH_REFUSED if preauth else PROTOCOL_ERROR,
                where,
                "bad proof" if preauth else "bad tag",
                detail=exc,
            )
        except (RemoteProtocolError, ProtocolError) as exc:
            self.audit.note(
                PROTOCOL_ERROR, where, "malformed", detail=exc, authenticated=not preauth
            )
        except (TimeoutError, TransportError):  # the hello deadline; a stuck reader
            self.audit.note(BUDGET_HIT, where, "hello_deadline" if preauth else "send_timeout")
        except ConnectionError:
            pass
        finally:
            if preauth:
                self._preauth_per_peer.release(addr)
                self._preauth_total.release("*")
            self._conns_per_peer.release(addr)
            if self.directory is not None:
                self.directory.expire_all(owner)
            self.watches.close(owner)
            self.index.forget_owner(owner)
            session.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._conns.discard(task)
            self._sessions.discard(session)

    def _hello(self) -> dict[str, Any]:
        return {
            "name": next(iter(self.transports.values())).name,
            "spec": spec_fields(self.store.spec),
            "lease_ttl": self.lease_ttl,
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
                lease, slots, gens = d.acquire(keys_of(msg), owner)
                return {"lease": lease, "slots": slots, "gens": gens}
            if op == "release":
                return {"valid": d.release(_int(msg, "lease"))}
            if op == "reserve":
                lease, slots = d.reserve(keys_of(msg), owner)
                return {"lease": lease, "slots": slots}
            if op == "commit":
                stored = d.commit(_int(msg, "lease"), bool(msg.get("ok")))
                if stored and self._changed is not None:
                    self._changed.set()  # peers hear of published pages at once
                return {"stored": stored}
            if op == "locate":
                return {"nodes": self.locate(keys_of(msg))}
            if op == "watch":
                return {"held": self.watches.watch(owner, session, keys_of(msg), self._holds)}
            if op == "unwatch":
                self.watches.unwatch(owner, keys_of(msg))
                return {}
            if op == "hold":
                return self._hold(msg, owner, session, addr)
            if op == "hello":
                return self._hello()
            if op == "stats":
                return self.stats()
        except RemoteFullError as exc:
            return {"err": "full", "msg": str(exc)}
        except TierKVError as exc:  # a malformed request, or one the page table refused
            return {"err": "bad", "msg": f"{type(exc).__name__}: {exc}"}
        return {"err": "op", "msg": f"unknown op {op!r}"}

    def stats(self) -> dict[str, Any]:
        """Pages served (readable content pages in the host tier), leases, expiries."""
        d = self.directory
        assert d is not None
        table = self.store.tiers.table
        return {
            "pages": len(d.entries()),
            "host_used": table.used("host"),
            "host_capacity": table.capacity("host"),
            "leases": d.leases,
            "expired": d.expired,
            "peers": sorted(self.links),
            "peers_connected": sum(1 for link in self.links.values() if link.connected),
            "peer_pages": self.index.pages(),
            "watchers": self.watches.watchers,
            "announced": self.watches.announced,
            "watchers_dropped": self.watches.dropped,
            "peer_links_refused_total": self.links_refused,
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

    # -- the directory shared with peers, and announcements --------------------------------
    def _holds(self, key: bytes) -> bool:
        table = self.store.tiers.table
        return _is_content(key) and bool(table.lookup([key], HOST))

    def locate(self, keys: list[bytes]) -> list[str]:
        """For the leading pages of ``keys`` that some node holds, the address of one
        (ours first); stops at the first page no known node holds."""
        out: list[str] = []
        for k in keys:
            node = self.address if self._holds(k) else self.index.locate(k)
            if node is None:
                break
            out.append(node)
        return out

    def add_peer(self, address: str, *, configured: bool = True) -> bool:
        """Link to another page server (idempotent); False when it is us, over ``max_peers``,
        or (not ``configured``: learned from a peer) over the link rate. Raises ValueError
        for an address that is not ``host:port``."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"peer address must be host:port, got {address!r}")
        if address == self.address or address in self.links:
            return False
        if len(self.links) >= self.max_peers or not (configured or self._link_budget.take()):
            self.links_refused += 1
            return False
        if configured:
            self._configured.add(address)
        link = PeerLink(
            self.address,
            address,
            secret=self.secret,
            timeout=self.timeout,
            interval=self.sync_interval,
            held=lambda: set(self._held),
            on_peers=self._learn,
            ssl=self.peer_ssl,
        )
        self.links[address] = link
        link.start()
        return True

    def _learn(self, addresses: list[str]) -> None:
        """Peers a server we dialled (and that proved the secret) announced."""
        for a in addresses:
            with contextlib.suppress(ValueError):
                self.add_peer(a, configured=False)

    def _hold(
        self, msg: dict[str, Any], owner: object, session: StreamSession, addr: str
    ) -> dict[str, Any]:
        node = msg.get("node")
        if not isinstance(node, str) or not node or len(node) > 256:
            raise RemoteProtocolError("hold needs the sender's node address")
        add, drop = keys_field(msg, "add"), keys_field(msg, "drop")
        self.index.apply(node, owner, add, drop, full=bool(msg.get("full")))
        # link back (so it hears our holdings) only to a page server that authenticated as
        # such and announces itself at the address it connects from: never where a client says
        host = node.rpartition(":")[0].removeprefix("[").removesuffix("]")
        if session.peer_role == PAGE_SERVER and same_host(host, addr):
            with contextlib.suppress(ValueError):
                self.add_peer(node, configured=False)
        return {"peers": [self.address, *self.links]}

    def _on_left(self, keys: list[bytes]) -> None:
        """Pages left our host tier: announce them now; peers hear of it at the next sync."""
        self.watches.announce(keys)
        if self._changed is not None:
            self._changed.set()

    async def _sync_loop(self) -> None:
        assert self._changed is not None and self.directory is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.sync_interval)
            await asyncio.sleep(self.sync_linger)  # let a burst of changes collect
            self._changed.clear()
            now = self.directory.held()
            added, dropped = now - self._held, self._held - now
            self._held = now
            if dropped:
                self.watches.announce(dropped)  # departures no hook reported
            if added or dropped:
                for link in self.links.values():
                    link.changed(added, dropped)
            await self._drop_dead_links()

    async def _drop_dead_links(self) -> None:
        """Learned links that never connected after DEAD_AFTER tries go (configured ones stay)."""
        for address, link in list(self.links.items()):
            dead = link.failures >= DEAD_AFTER and not link.ever_connected
            if dead and address not in self._configured:
                del self.links[address]
                await link.aclose()


def _int(msg: dict[str, Any], name: str) -> int:
    value = msg.get(name)
    if type(value) is not int:
        raise RemoteProtocolError(f"{name} must be an integer")
    return value


def _packed(shared: SharedArena) -> bytes:
    return shared.region.descriptor.pack()
