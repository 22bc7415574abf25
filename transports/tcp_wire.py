"""The tcp transport's wire format: frames, the handshake's MACs, and a framing protocol that
receives payloads straight into registered memory (asyncio's `BufferedProtocol`).

Every frame::

    ┌───────────┬────────────────────────────┬──────────────────────────────┐
    │ u32 hlen  │ header: msgpack map (hlen) │ payload: header["n"] bytes   │
    └───────────┴────────────────────────────┴──────────────────────────────┘

Header fields: "op" (str), "id" (request id), "segs" ([[region, offset, length], ...]),
"n" (payload bytes, default 0), "crc" (the payload's checksum: in a write; `true` in a read
asks for one, which version 2 sends in a "crc" frame {"op", "id", "crc"} right after the data
frame, version 1 in the data frame's header). Before the handshake completes a peer may send
only small headers (HANDSHAKE_HEADER bytes, within the timeout) and no payload. The handshake
is the mutual one of session.py (both sides prove the secret over the transcript: both nonces,
both agents, both roles), carries the wire version ("v": 3; older peers are refused) and agrees
on the connection's checksum algorithm (see checksum.py)::

    server                                     client
      challenge {v, agent, nonce}      ──────>
                                       <──────   auth {v, agent, nonce, mac, csums: [...]}
      welcome {v, mac, csum, limits}   ──────>   (csum: the client's first choice we have)

From then on every header carries a 16-byte tag under the session key of its direction
(``u32 hlen | header | tag16``, hlen counting the tag; sequence numbers implicit): a forged,
replayed or reordered header ends the connection. Payloads are not tagged: they keep their
checksum, which the tagged header (or "crc" frame) carries.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any, cast

import msgpack

from .errors import AuthError, ProtocolError
from .session import TAG_BYTES, Limits, Seal, unpack

__all__ = [
    "CLIENT_ROLE",
    "SERVER_ROLE",
    "WIRE_VERSION",
    "FrameProtocol",
    "frame",
    "parse_segs",
]

#: Version 2 added "v", the checksum negotiation and the read reply's "crc" trailer frame;
#: version 3 the mutual, session-bound handshake and tagged headers. Only 3 is spoken.
WIRE_VERSION = 3
SERVER_ROLE, CLIENT_ROLE = "tcp-server", "tcp-client"
PREFIX = struct.Struct("!I")
HANDSHAKE_HEADER = 1024
MAX_HEADER = 1 << 20
MAX_SEGS = 8192
MAX_NOTIFY = 1 << 16
_SCRATCH = 1 << 16
HANDSHAKE_LIMITS = Limits(frame=HANDSHAKE_HEADER, array=8, map=16, str=256, bin=64)
HEADER_LIMITS = Limits(frame=MAX_HEADER, array=MAX_SEGS, map=16, str=1024, bin=MAX_NOTIFY)


def frame(header: dict[str, Any], seal: Seal | None = None) -> bytes:
    """The prefix and header of a frame, tagged under ``seal`` when given (its payload, if
    any, follows separately)."""
    body = msgpack.packb(header)
    if seal is None:
        return PREFIX.pack(len(body)) + body
    return PREFIX.pack(len(body) + TAG_BYTES) + body + seal.tag(body)


def parse_segs(header: dict[str, Any], max_segs: int) -> list[tuple[int, int, int]]:
    """The validated "segs" of a request header. Raises ProtocolError."""
    segs = header.get("segs")
    if not isinstance(segs, list) or len(segs) > max_segs:
        raise ProtocolError("segs missing, not a list, or too many")
    out = []
    for s in segs:
        if not (isinstance(s, list) and len(s) == 3 and all(type(x) is int for x in s)):
            raise ProtocolError(f"malformed segment {s!r}")
        if s[1] < 0 or s[2] < 0:
            raise ProtocolError(f"negative offset or length in {s!r}")
        out.append((s[0], s[1], s[2]))
    return out


class FrameProtocol(asyncio.BufferedProtocol):
    """Splits the byte stream into frames; subclasses implement `on_header` / `on_frame`.

    `on_header(header)` returns where the payload goes (views whose lengths sum to "n"), or
    None to discard it; `on_payload(view)` sees each piece as it lands (while it is still in
    cache). `on_frame(header)` runs once the payload has landed. A ProtocolError
    from either (or from framing) calls `on_protocol_error` and closes the connection.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.max_header = HANDSHAKE_HEADER
        self.max_payload = 0
        self.limits = HANDSHAKE_LIMITS
        self.tx_seal: Seal | None = None  # set once the handshake completed
        self.rx_seal: Seal | None = None
        self._hbuf = bytearray(4)
        self._want = 4  # bytes of the prefix or header still expected in _hbuf
        self._in_header = False
        self._header: dict[str, Any] | None = None
        self._dests: list[memoryview] = []
        self._discard = 0  # payload bytes to drop
        self._scratch: memoryview | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self.closed = False

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dests:
            return self._dests[0]
        if self._discard:
            if self._scratch is None:
                self._scratch = memoryview(bytearray(_SCRATCH))
            return self._scratch[: min(self._discard, _SCRATCH)]
        return memoryview(self._hbuf)[len(self._hbuf) - self._want :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._advance(nbytes)
        except ProtocolError as exc:
            self.on_protocol_error(exc)
            self.abort()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- framing ---------------------------------------------------------------------------

    def _advance(self, n: int) -> None:
        if self._dests:
            head = self._dests[0]
            self.on_payload(head[:n])
            if n < len(head):
                self._dests[0] = head[n:]
                return
            self._dests.pop(0)
            if not self._dests:
                self._frame_done()
            return
        if self._discard:
            self._discard -= n
            if not self._discard:
                self._frame_done()
            return
        self._want -= n
        if self._want:
            return
        if not self._in_header:
            (hlen,) = PREFIX.unpack(self._hbuf)
            tag = TAG_BYTES if self.rx_seal is not None else 0
            if not tag < hlen <= self.max_header + tag:
                raise ProtocolError(f"header of {hlen} bytes (limit {self.max_header})")
            self._hbuf, self._want, self._in_header = bytearray(hlen), hlen, True
            return
        self._in_header = False
        self._take_header(bytes(self._hbuf))
        self._hbuf, self._want = bytearray(4), 4

    def _take_header(self, raw: bytes) -> None:
        body = memoryview(raw)
        if self.rx_seal is not None:
            body = body[:-TAG_BYTES]
            try:
                self.rx_seal.check(body, raw[-TAG_BYTES:])
            except AuthError as exc:
                raise ProtocolError(str(exc)) from exc
        header = unpack(body, self.limits)
        if not isinstance(header.get("op"), str):
            raise ProtocolError("header is not a map with an 'op'")
        n = header.get("n", 0)
        if type(n) is not int or not 0 <= n <= self.max_payload:
            raise ProtocolError(f"payload of {n!r} bytes (limit {self.max_payload})")
        self._header = header
        dests = self.on_header(header)
        if dests is None:
            self._discard = n
        else:
            self._dests = [d for d in dests if len(d)]
            if sum(len(d) for d in self._dests) != n:
                raise ProtocolError(f"payload of {n} bytes does not match its segments")
        if n == 0:
            self._frame_done()

    def _frame_done(self) -> None:
        header, self._header = self._header, None
        assert header is not None
        self.on_frame(header)

    # -- for subclasses ----------------------------------------------------------------------

    def on_header(self, header: dict[str, Any]) -> list[memoryview] | None:
        """Where the payload of this frame goes (None: discard it)."""
        return None

    def on_payload(self, landed: memoryview) -> None:
        """These payload bytes have just landed (in order; called before `on_frame`)."""

    def on_frame(self, header: dict[str, Any]) -> None:
        """A whole frame (header and payload) has arrived."""

    def on_protocol_error(self, exc: ProtocolError) -> None:
        """The stream broke the protocol; the connection is being aborted."""

    def send(self, header: dict[str, Any], payload: Sequence[memoryview] = ()) -> None:
        """Queue one frame (no copy of `payload` when the socket takes it at once)."""
        if self.transport is None or self.closed:
            return
        self.transport.write(frame(header, self.tx_seal))
        for view in payload:
            if len(view):
                self.transport.write(view)

    async def drain(self) -> None:
        """Wait while the send buffer is above its high-water mark."""
        if self._paused and not self.closed:
            if self._drain is None or self._drain.done():
                self._drain = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drain)  # shared by all writers; one cancelled is no harm

    def abort(self) -> None:
        """Drop the connection at once: no further byte is received."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
