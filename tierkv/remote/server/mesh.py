"""The directory the page servers share, as one server keeps it: links to peers, what they hold,
and the sync of our own holdings to them (gossip.py holds the index and one link)::

    configured seeds ─┐                      PeerLink(B) --hold {node, full, add, drop}--> B
    peers B announced ┘─> add_peer ─> links  (every `interval`, sooner when pages change)
                          (capped, learned ones rate limited)
    hold from a peer  ─> index.apply          locate(keys): ours first, then the index
    hold from a page server we have no link to ─> BackLink: our holdings as events on its
                                                  own connection (no dial)

The server dials only peers the operator configured and peers that servers we dialled (and that
proved the secret) announce, rate limited; never an address named by whoever is connected to
it (a page server that links to us hears our holdings on its own connection). Learned links
that never connected after `DEAD_AFTER` tries are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from tierkv.errors import InvalidInputError
from tierkv.remote.errors import RemoteProtocolError
from tierkv.remote.protocol.wire import PAGE_SERVER
from tierkv.remote.server.gossip import BackLink, PeerIndex, PeerLink, keys_field
from tierkv.transports.guard import RateLimit
from tierkv.transports.session import StreamSession

__all__ = ["DEAD_AFTER", "Mesh"]

DEAD_AFTER = 5  # failed tries after which a learned peer link that never connected is dropped


class Mesh:
    """This server's links to other page servers and the index of what they hold.

    Args:
        address: our address as peers reach it (called when needed: the port is known once
            the control socket is bound).
        holds: whether our host tier holds a page now.
        held: the content pages our host tier holds now (the full set a link sends).
        on_departed: pages that left our host tier without a hook reporting them.
        secret / timeout / ssl: of the links (client side).
        interval / linger: a link's sync period when nothing changes, and how long a burst of
            changes collects before it goes out.
        max_peers: the most links kept; links_per_minute: new learned links allowed.
    """

    def __init__(
        self,
        address: Callable[[], str],
        *,
        holds: Callable[[bytes], bool],
        held: Callable[[], set[bytes]],
        on_departed: Callable[[set[bytes]], None],
        secret: bytes,
        timeout: float,
        interval: float,
        linger: float,
        max_peers: int,
        links_per_minute: float,
        ssl: SSLContext | None,
    ) -> None:
        self._address, self._holds, self._held_now = address, holds, held
        self._on_departed = on_departed
        self.secret, self.timeout, self.ssl = secret, timeout, ssl
        self.interval, self.linger, self.max_peers = interval, linger, max_peers
        self.index = PeerIndex()
        self.links: dict[str, PeerLink] = {}
        self.back: dict[object, BackLink] = {}  # connection -> our holdings pushed on it
        self.links_refused = 0
        self._configured: set[str] = set()
        self._budget = RateLimit(links_per_minute / 60.0, max(1.0, links_per_minute))
        self._held: set[bytes] = set()
        self._changed: asyncio.Event | None = None
        self._sync: asyncio.Task[None] | None = None

    def start(self, seeds: list[str]) -> None:
        """Start the sync task and link to ``seeds`` (configured peers)."""
        self._changed = asyncio.Event()
        self._held = self._held_now()
        self._sync = asyncio.get_running_loop().create_task(self._sync_loop())
        for peer in seeds:
            self.add_peer(peer, configured=True)

    async def aclose(self) -> None:
        """Stop syncing and close every link."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sync
        for link in list(self.links.values()):
            await link.aclose()
        self.links.clear()
        for back in self.back.values():
            back.close()
        self.back.clear()

    def closed(self, owner: object) -> None:
        """A connection ended: what it told us goes, and so does our push on it."""
        self.index.forget_owner(owner)
        back = self.back.pop(owner, None)
        if back is not None:
            back.close()

    def changed(self) -> None:
        """Our holdings changed: peers hear of it within `linger`."""
        if self._changed is not None:
            self._changed.set()

    @property
    def connected(self) -> int:
        """Links connected now."""
        return sum(1 for link in self.links.values() if link.connected)

    def locate(self, keys: list[bytes]) -> list[str]:
        """For the leading pages of ``keys`` that some node holds, the address of one (ours
        first); stops at the first page no known node holds."""
        out: list[str] = []
        ours = self._address()
        for k in keys:
            node = ours if self._holds(k) else self.index.locate(k)
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
            raise InvalidInputError(f"peer address must be host:port, got {address!r}")
        if address == self._address() or address in self.links:
            return False
        if len(self.links) >= self.max_peers or not (configured or self._budget.take()):
            self.links_refused += 1
            return False
        if configured:
            self._configured.add(address)
        link = PeerLink(
            self._address(),
            address,
            secret=self.secret,
            timeout=self.timeout,
            interval=self.interval,
            held=lambda: set(self._held),
            on_peers=self.learn,
            on_hold=self.index.apply,
            forget=self.index.forget_owner,
            ssl=self.ssl,
        )
        self.links[address] = link
        link.start()
        return True

    def learn(self, addresses: list[str]) -> None:
        """Peers a server we dialled (and that proved the secret) announced: link to them,
        within the link rate."""
        for a in addresses:
            with contextlib.suppress(ValueError):
                self.add_peer(a, configured=False)

    def hold(
        self, msg: dict[str, Any], owner: object, session: StreamSession, addr: str
    ) -> dict[str, Any]:
        """A peer's ``hold`` message (its holdings, kept while ``owner``, its connection,
        lives). Raises RemoteProtocolError for a malformed one."""
        node = msg.get("node")
        if not isinstance(node, str) or not node or len(node) > 256:
            raise RemoteProtocolError("hold needs the sender's node address")
        add, drop = keys_field(msg, "add"), keys_field(msg, "drop")
        self.index.apply(node, owner, add, drop, full=bool(msg.get("full")))
        # a page server we have no link to hears our holdings on its own connection: we
        # never dial the address it claims (nor any other a connected party names)
        if (
            session.peer_role == PAGE_SERVER
            and node not in self.links
            and owner not in self.back
            and len(self.back) < self.max_peers
        ):
            back = BackLink(session, node, held=lambda: set(self._held), timeout=self.timeout)
            self.back[owner] = back
            back.start()
        known = dict.fromkeys([*self.links, *(b.node for b in self.back.values())])
        return {"peers": [self._address(), *known]}

    async def _sync_loop(self) -> None:
        assert self._changed is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.interval)
            await asyncio.sleep(self.linger)  # let a burst of changes collect
            self._changed.clear()
            now = self._held_now()
            added, dropped = now - self._held, self._held - now
            self._held = now
            if dropped:
                self._on_departed(dropped)  # departures no hook reported
            if added or dropped:
                for link in self.links.values():
                    link.changed(added, dropped)
                for back in self.back.values():
                    back.changed(added, dropped)
            await self._drop_dead_links()

    async def _drop_dead_links(self) -> None:
        for address, link in list(self.links.items()):
            dead = link.failures >= DEAD_AFTER and not link.ever_connected
            if dead and address not in self._configured:
                del self.links[address]
                await link.aclose()
