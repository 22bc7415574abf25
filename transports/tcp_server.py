"""The tcp transport's server side: one `ServerConnection` per accepted peer.

It authenticates the peer (challenge -> auth -> welcome), then serves requests in order:
"read" (answered by "data" + payload), "write" (payload received straight into the region,
answered by "ok"), "notify" (no answer). Every segment is bounds-checked against the regions
registered at that moment; a refused request gets an "err" frame and the connection lives on.
A frame that breaks the protocol gets an "err" (when possible) and the connection is dropped.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from typing import TYPE_CHECKING, Any

from .errors import ProtocolError, RemoteAccessError
from .tcp_wire import MAX_HEADER, MAX_SEGS, FrameProtocol, checksum, mac, parse_segs

if TYPE_CHECKING:
    from .tcp import TcpTransport

__all__ = ["ServerConnection"]


class ServerConnection(FrameProtocol):
    """Serves one authenticated peer against `owner`'s registered regions."""

    def __init__(self, owner: TcpTransport) -> None:
        super().__init__()
        self.owner = owner
        self.peer: str | None = None
        self._nonce = secrets.token_bytes(16)
        self._refusal: dict[str, Any] | None = None  # answer for a write whose payload we drop
        self._views: list[memoryview] = []
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.owner._server_conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(self.owner.timeout, self._expire)
        self.send({"op": "challenge", "agent": self.owner.name, "nonce": self._nonce})

    def _expire(self) -> None:
        if self.peer is None:
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.owner._server_conns.discard(self)
        if self._timer is not None:
            self._timer.cancel()

    def pause_writing(self) -> None:  # stop taking requests while replies pile up
        super().pause_writing()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def on_protocol_error(self, exc: ProtocolError) -> None:
        self.send({"op": "err", "id": -1, "code": "protocol", "msg": str(exc)[:200]})

    def on_header(self, header: dict[str, Any]) -> list[memoryview] | None:
        if header["op"] != "write" or self.peer is None:
            return None
        self._refusal, self._views = None, []
        try:
            self._views = self._resolve(header)
        except RemoteAccessError as exc:
            self._refusal = _err(header, "access", exc)
            return None
        return self._views

    def on_frame(self, header: dict[str, Any]) -> None:
        op = header["op"]
        if self.peer is None:
            return self._authenticate(header)
        if op == "read":
            try:
                views = self._resolve(header)
            except RemoteAccessError as exc:
                return self.send(_err(header, "access", exc))
            total = sum(len(v) for v in views)
            reply = {"op": "data", "id": header.get("id"), "n": total}
            if header.get("crc"):
                reply["crc"] = checksum(views)
            return self.send(reply, views)
        if op == "write":
            if self._refusal is not None:
                return self.send(self._refusal)
            crc = header.get("crc")
            if crc is not None and crc != checksum(self._views):
                return self.send(_err(header, "checksum", ProtocolError("checksum mismatch")))
            return self.send({"op": "ok", "id": header.get("id")})
        if op == "notify" and isinstance(header.get("data"), bytes):
            return self.owner._deliver(self.peer, header["data"])
        raise ProtocolError(f"unexpected {op!r} frame")

    def _resolve(self, header: dict[str, Any]) -> list[memoryview]:
        segs = parse_segs(header, MAX_SEGS)
        views = [self.owner._serve_view(rid, off, n) for rid, off, n in segs]
        if sum(len(v) for v in views) > self.max_payload:
            raise ProtocolError("request larger than the frame limit")
        return views

    def _authenticate(self, header: dict[str, Any]) -> None:
        agent, nonce, proof = header.get("agent"), header.get("nonce"), header.get("mac")
        secret = self.owner._secret
        if not (
            header["op"] == "auth"
            and isinstance(agent, str)
            and isinstance(nonce, bytes)
            and isinstance(proof, bytes)
            and hmac.compare_digest(
                proof, mac(secret, b"tierkv-client", self._nonce, nonce, agent.encode())
            )
        ):
            self.send({"op": "err", "id": -1, "code": "auth", "msg": "authentication failed"})
            raise ProtocolError("authentication failed")
        self.peer = agent
        self.max_header, self.max_payload = MAX_HEADER, self.owner.max_frame
        if self._timer is not None:
            self._timer.cancel()
        self.send(
            {
                "op": "welcome",
                "mac": mac(secret, b"tierkv-server", nonce, self._nonce, self.owner.name.encode()),
                "max_payload": self.owner.max_frame,
                "max_segs": MAX_SEGS,
            }
        )


def _err(header: dict[str, Any], code: str, exc: Exception) -> dict[str, Any]:
    return {"op": "err", "id": header.get("id"), "code": code, "msg": str(exc)[:200]}
