"""Hostile frames against a tcp server (hypothesis): malformed, oversized, unauthenticated and
out-of-bounds requests are refused, and the server keeps serving a well-behaved peer."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transports import TransferOp
from transports.checksum import algorithms, checksum_function
from transports.tcp import TcpTransport
from transports.tcp_wire import PREFIX, WIRE_VERSION, frame, mac

SECRET = b"frames"
PATTERN = bytes(range(256)) * 64  # 16 KiB


class Server:
    """A TcpTransport serving one region from its own loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _, ctx: self.errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.t = self.call(TcpTransport("srv", secret=SECRET, max_frame=1 << 20).start())
        self.guarded = self.t.register_memory(bytearray(PATTERN))  # never a write target
        self.scratch = self.t.register_memory(bytearray(len(PATTERN)))

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def healthy(self) -> bool:
        """A well-behaved peer can still read the guarded region, bit-exact."""

        async def probe() -> bytes:
            async with TcpTransport(secret=SECRET, timeout=5) as c:
                await c.add_peer(self.t.metadata())
                mine = c.allocate(len(PATTERN))
                await c.read([TransferOp(mine, 0, self.guarded.descriptor, 0, len(PATTERN))])
                return bytes(mine.view)

        return self.call(probe()) == PATTERN and bytes(self.guarded.view) == PATTERN

    def close(self) -> None:
        self.call(self.t.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = PREFIX.unpack(sock.recv(4, socket.MSG_WAITALL))
    header: dict[str, Any] = msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))
    return header


def _auth(sock: socket.socket, **fields: Any) -> dict[str, Any]:
    """Answer the challenge with a valid MAC (plus `fields`); the server's reply."""
    challenge = _recv_frame(sock)
    assert challenge["v"] == WIRE_VERSION
    nonce = secrets.token_bytes(16)
    proof = mac(SECRET, b"tierkv-client", challenge["nonce"], nonce, b"fuzzer")
    auth = {"op": "auth", "agent": "fuzzer", "nonce": nonce, "mac": proof, **fields}
    sock.sendall(frame(auth))
    return _recv_frame(sock)


def _connect(server: Server, authenticate: bool, csum: str = "crc32") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.t.port), timeout=5)
    if authenticate:
        welcome = _auth(sock, v=WIRE_VERSION, csums=[csum])
        assert welcome["op"] == "welcome" and welcome["csum"] == csum
    else:
        _recv_frame(sock)  # the challenge
    return sock


def _send_and_drain(sock: socket.socket, data: bytes) -> None:
    """Send, half-close, and read until the server closes: it has then handled every byte."""
    with sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except OSError:  # the server may drop us before we finish: that is a refusal
            pass


ints = st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 1, 2, 3, 16383, 16384, 2**31]))
segs = st.lists(st.lists(ints, min_size=0, max_size=4), max_size=5)
headers = st.fixed_dictionaries(
    {"op": st.sampled_from(["read", "write", "notify", "data", "ok", "auth", "zzz"])},
    optional={
        "id": ints,
        "segs": st.one_of(segs, st.text(max_size=5), ints),
        "n": st.one_of(ints, st.text(max_size=3)),
        "crc": st.one_of(ints, st.booleans()),
        "data": st.binary(max_size=16),
        "v": ints,
        "csums": st.lists(st.sampled_from(["crc32", "crc32c", "md5", ""]), max_size=3) | ints,
        "agent": st.text(max_size=5),
        "nonce": st.binary(max_size=16),
        "mac": st.binary(max_size=32),
    },
)


def _frame_bytes(header: dict[str, Any], payload: bytes, bad_len: int | None) -> bytes:
    body = msgpack.packb(header)
    n = len(body) if bad_len is None else bad_len
    return PREFIX.pack(n % 2**32) + body + payload


hostile = st.one_of(
    st.binary(max_size=64),
    st.builds(_frame_bytes, headers, st.binary(max_size=64), st.none() | st.integers(0, 2**32)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hostile, authenticate=st.booleans())
def test_hostile_frames_leave_the_server_serving(
    server: Server, data: bytes, authenticate: bool
) -> None:
    _send_and_drain(_connect(server, authenticate), data)
    assert bytes(server.guarded.view) == PATTERN  # no write lands in a region it did not name
    assert not server.errors


def test_specific_refusals(server: Server) -> None:
    big = PREFIX.pack(1 << 30)  # an oversized header, before and after authentication
    _send_and_drain(_connect(server, False), big)
    _send_and_drain(_connect(server, True), big)
    oversized = {"op": "write", "id": 1, "segs": [[server.scratch.region_id, 0, 16]], "n": 2 << 20}
    _send_and_drain(_connect(server, True), frame(oversized))
    unauth_write = {"op": "write", "segs": [[server.guarded.region_id, 0, 4]], "n": 4}
    _send_and_drain(_connect(server, False), frame(unauth_write) + b"XXXX")
    sock = _connect(server, True)  # out of bounds: refused with an error frame, stream lives on
    oob = {"op": "write", "id": 1, "segs": [[server.guarded.region_id, 16380, 8]], "n": 8}
    sock.sendall(frame(oob) + b"\xff" * 8)
    reply = _recv_frame(sock)
    assert reply["op"] == "err" and reply["code"] == "access"
    sock.sendall(frame({"op": "read", "id": 2, "segs": [[server.guarded.region_id, 0, 4]]}))
    reply = _recv_frame(sock)
    assert reply["op"] == "data" and sock.recv(4, socket.MSG_WAITALL) == PATTERN[:4]
    sock.close()
    assert bytes(server.guarded.view) == PATTERN
    assert server.healthy()
    assert not server.errors


def test_handshake_agrees_on_version_and_checksum(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.t.port), timeout=5) as sock:
        assert _auth(sock)["csum"] == "crc32"  # a version-1 peer (no "v"): zlib crc32
    with socket.create_connection(("127.0.0.1", server.t.port), timeout=5) as sock:
        welcome = _auth(sock, v=WIRE_VERSION, csums=["md5", *algorithms()])
        assert welcome["v"] == WIRE_VERSION and welcome["csum"] == algorithms()[0]
    for bad in ({"v": WIRE_VERSION, "csums": ["md5"]}, {"v": WIRE_VERSION}, {"v": "2"}):
        with socket.create_connection(("127.0.0.1", server.t.port), timeout=5) as sock:
            reply = _auth(sock, **bad)
            assert reply["op"] == "err" and reply["code"] == "protocol", bad
            assert sock.recv(1) == b""  # and the connection is closed
    assert server.healthy()


@pytest.mark.parametrize("csum", algorithms())
def test_bad_write_checksum_is_refused(server: Server, csum: str) -> None:
    seg = [[server.scratch.region_id, 0, 4096]]
    payload = bytes(range(256)) * 16
    crc = checksum_function(csum)([memoryview(payload)])
    with _connect(server, True, csum) as sock:
        sock.sendall(frame({"op": "write", "id": 1, "segs": seg, "n": 4096, "crc": crc ^ 1}))
        sock.sendall(payload)
        reply = _recv_frame(sock)
        assert reply["op"] == "err" and reply["code"] == "checksum"
        sock.sendall(frame({"op": "write", "id": 2, "segs": seg, "n": 4096, "crc": crc}))
        sock.sendall(payload)
        assert _recv_frame(sock) == {"op": "ok", "id": 2}
        sock.sendall(frame({"op": "read", "id": 3, "segs": seg, "crc": True}))
        assert _recv_frame(sock) == {"op": "data", "id": 3, "n": 4096}
        assert sock.recv(4096, socket.MSG_WAITALL) == payload
        assert _recv_frame(sock) == {"op": "crc", "id": 3, "crc": crc}  # version 2: a trailer
    with socket.create_connection(("127.0.0.1", server.t.port), timeout=5) as sock:
        assert _auth(sock)["csum"] == "crc32"  # version 1: the crc rides in the data header
        sock.sendall(frame({"op": "read", "id": 1, "segs": seg, "crc": True}))
        crc32 = checksum_function("crc32")([memoryview(payload)])
        assert _recv_frame(sock) == {"op": "data", "id": 1, "n": 4096, "crc": crc32}
        assert sock.recv(4096, socket.MSG_WAITALL) == payload
    assert not server.errors


def test_healthy_after_fuzzing(server: Server) -> None:
    assert server.healthy()
