"""An accept loop that refuses cheaply: a connection is judged by its peer address alone, before
anything is read from it or allocated for it (no transport, protocol, stream or task)::

    listening socket readable ─> accept() ─> Gate.admit(address)
                                              ├─ admitted: on_admitted(sock, address)
                                              └─ refused (a budget hit, counted):
                                                   held unread, up to `max_held` at once, for
                                                   `hold_s`, then reset (SO_LINGER 0: no
                                                   FIN exchange, no TIME_WAIT); past
                                                   `max_held`, reset at once

Holding a refused connection is a tarpit: a flooding client that waits for an answer waits
`hold_s` before it reconnects, instead of costing an accept every millisecond; one that does
not wait costs an accept and a close. Held sockets are closed by one timer armed for the
oldest (no polling). asyncio's own server makes a task, a transport and a protocol for every
accepted connection before its owner can say no; this loop makes none for a refused one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import socket
import struct
import time
from collections.abc import Callable

from .guard import BUDGET_HIT, Audit, Gate

__all__ = ["Acceptor", "listen", "reset"]

_LINGER_0 = struct.pack("ii", 1, 0)
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
ACCEPT_RETRY_S = 1.0  # after running out of file descriptors, accepting resumes this much later


def listen(
    host: str | None, port: int, *, backlog: int = 1024, rcvbuf: int | None = None
) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address ``host`` resolves to (all
    interfaces for None / ""), on one port (chosen by the first when ``port`` is 0).
    ``rcvbuf``: SO_RCVBUF, inherited by accepted sockets (bounds what one read can take).
    Raises OSError."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if rcvbuf is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            if port == 0 and len(socks) > 1:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0): nothing is flushed, no TIME_WAIT remains."""
    with contextlib.suppress(OSError):  # already reset by the peer
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    sock.close()


class Acceptor:
    """Accept on ``socks`` (from `listen`) and admit through ``gate``.

    Args:
        socks: listening, non-blocking sockets (the acceptor closes them in `close`).
        gate: decides per address; an admitted connection's owner reports to it.
        on_admitted: takes an admitted, non-blocking socket and its peer address (the owner
            then closes it and calls ``gate.closed``).
        audit: counts each refusal as a budget hit (reason: the refusing budget).
        hold_s / max_held: the tarpit (0 held: reset at once).
    """

    def __init__(
        self,
        socks: list[socket.socket],
        gate: Gate,
        on_admitted: Callable[[socket.socket, str], None],
        audit: Audit,
        *,
        hold_s: float = 5.0,
        max_held: int = 256,
    ) -> None:
        self.socks, self.gate, self.audit = socks, gate, audit
        self._on_admitted = on_admitted
        self.hold_s, self.max_held = hold_s, max_held
        self._held: collections.deque[tuple[float, socket.socket]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.refused = 0

    @property
    def port(self) -> int:
        """The port we listen on."""
        return int(self.socks[0].getsockname()[1])

    @property
    def held(self) -> int:
        """Refused connections held in the tarpit now."""
        return len(self._held)

    def start(self) -> None:
        """Start accepting on the running loop."""
        self._loop = asyncio.get_running_loop()
        for sock in self.socks:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        """Stop accepting, close the listening sockets, reset every held connection."""
        if self._loop is not None:
            for sock in self.socks:
                if sock.fileno() >= 0:
                    self._loop.remove_reader(sock.fileno())
        for sock in self.socks:
            sock.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._held:
            reset(self._held.popleft()[1])

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # a burst, then back to the loop (the rest next time)
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS and self._loop is not None:
                    self.audit.note(BUDGET_HIT, "*", "file_descriptors", detail=exc)
                    self._loop.remove_reader(listener.fileno())
                    self._loop.call_later(ACCEPT_RETRY_S, self._resume, listener)
                return
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            reason = self.gate.admit(address)
            if reason is None:
                sock.setblocking(False)
                self._on_admitted(sock, address)
                continue
            self.refused += 1
            self.audit.note(BUDGET_HIT, address, reason)
            self._refuse(sock)

    def _resume(self, listener: socket.socket) -> None:
        if self._loop is not None and listener.fileno() >= 0:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    def _refuse(self, sock: socket.socket) -> None:
        if len(self._held) >= self.max_held or self.hold_s <= 0 or self._loop is None:
            return reset(sock)
        self._held.append((time.monotonic() + self.hold_s, sock))
        if self._timer is None:
            self._timer = self._loop.call_later(self.hold_s, self._release)

    def _release(self) -> None:
        self._timer = None
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            reset(self._held.popleft()[1])
        if self._held and self._loop is not None:
            self._timer = self._loop.call_later(self._held[0][0] - now, self._release)
