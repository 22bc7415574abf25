"""Hostile frames against a tcp server (hypothesis): malformed, oversized, unauthenticated and
out-of-bounds requests are refused, and the server keeps serving a well-behaved peer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.transports import TransferOp
from tierkv.transports.checksum import algorithms, checksum_function
from tierkv.transports.probe import Probe
from tierkv.transports.tcp import TcpTransport
from tierkv.transports.tcp_wire import PREFIX, WIRE_VERSION, frame

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
        # the penalty for failed handshakes is off: every hostile frame here comes from
        # 127.0.0.1, and the server must keep parsing them (test_acceptor.py tests it)
        t = TcpTransport("srv", secret=SECRET, max_frame=1 << 20, max_preauth_failures=None)
        self.t = self.call(t.start())
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


def _auth(server: Server, **fields: Any) -> tuple[Probe, dict[str, Any]]:
    """A probe that answered the challenge with a valid proof (plus `fields`), and the reply."""
    p = Probe.connect("127.0.0.1", server.t.port)
    return p, p.tcp_handshake(SECRET, agent="fuzzer", **fields)


def _connect(server: Server, authenticate: bool, csum: str = "crc32") -> Probe:
    if authenticate:
        p, welcome = _auth(server, v=WIRE_VERSION, csums=[csum])
        assert welcome["op"] == "welcome" and welcome["csum"] == csum
        return p
    p = Probe.connect("127.0.0.1", server.t.port)
    assert p.recv()["op"] == "challenge"  # type: ignore[index]
    return p


def _send_and_drain(p: Probe, data: bytes) -> None:
    """Send, half-close, and read until the server closes: it has then handled every byte."""
    sock = p.sock
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
@given(data=hostile, authenticate=st.booleans(), header=st.none() | headers)
def test_hostile_frames_leave_the_server_serving(
    server: Server, data: bytes, authenticate: bool, header: dict[str, Any] | None
) -> None:
    p = _connect(server, authenticate)
    if header is not None:  # a well-tagged header first: it reaches the parser after auth
        data = p.frame(header) + data
    _send_and_drain(p, data)
    assert bytes(server.guarded.view) == PATTERN  # no write lands in a region it did not name
    assert not server.errors


def test_specific_refusals(server: Server) -> None:
    big = PREFIX.pack(1 << 30)  # an oversized header, before and after authentication
    _send_and_drain(_connect(server, False), big)
    _send_and_drain(_connect(server, True), big)
    oversized = {"op": "write", "id": 1, "segs": [[server.scratch.region_id, 0, 16]], "n": 2 << 20}
    p = _connect(server, True)
    _send_and_drain(p, p.frame(oversized))
    unauth_write = {"op": "write", "segs": [[server.guarded.region_id, 0, 4]], "n": 4}
    _send_and_drain(_connect(server, False), frame(unauth_write) + b"XXXX")
    p = _connect(server, True)  # out of bounds: refused with an error frame, stream lives on
    oob = {"op": "write", "id": 1, "segs": [[server.guarded.region_id, 16380, 8]], "n": 8}
    p.send(oob, b"\xff" * 8)
    reply = p.recv()
    assert reply is not None and reply["op"] == "err" and reply["code"] == "access"
    p.send({"op": "read", "id": 2, "segs": [[server.guarded.region_id, 0, 4]]})
    reply = p.recv()
    assert reply is not None and reply["op"] == "data"
    assert p.sock.recv(4, socket.MSG_WAITALL) == PATTERN[:4]
    p.close()
    assert bytes(server.guarded.view) == PATTERN
    assert server.healthy()
    assert not server.errors


def test_untagged_replayed_and_reordered_frames_end_the_session(server: Server) -> None:
    """After the handshake every header needs its tag: an untagged, replayed or reordered one
    ends the connection before it is parsed."""
    read = {"op": "read", "id": 1, "segs": [[server.guarded.region_id, 0, 4]]}
    p = _connect(server, True)
    _send_and_drain(p, frame(read))  # untagged
    p = _connect(server, True)
    first = p.frame(read)
    p.sock.sendall(first)
    assert p.recv()["op"] == "data"  # type: ignore[index]
    assert p.sock.recv(4, socket.MSG_WAITALL) == PATTERN[:4]
    _send_and_drain(p, first)  # the same frame again: its sequence number has passed
    p = _connect(server, True)
    one, two = p.frame(read), p.frame({**read, "id": 2})
    _send_and_drain(p, two + one)  # reordered
    before = server.t.audit.counts["protocol_error"]
    p, _ = _auth(server, v=WIRE_VERSION)
    p.tx = None  # a peer that does not tag
    _send_and_drain(p, p.frame(read))
    assert server.t.audit.counts["protocol_error"] > before
    assert server.healthy()


def test_replayed_handshake_is_refused(server: Server) -> None:
    """An auth frame recorded from one connection fails on the next (a fresh server nonce)."""
    p = Probe.connect("127.0.0.1", server.t.port)
    sent: list[bytes] = []
    real = p.sock.sendall
    p.sock = _Recorder(p.sock, sent)  # type: ignore[assignment]
    assert p.tcp_handshake(SECRET, agent="fuzzer")["op"] == "welcome"
    p.close()
    before = server.t.audit.counts["auth_refused"]
    q = Probe.connect("127.0.0.1", server.t.port)
    assert q.recv()["op"] == "challenge"  # type: ignore[index]
    q.sock.sendall(sent[0])
    reply = q.recv()
    assert reply is not None and reply["op"] == "err" and reply["code"] == "auth"
    assert q.recv() is None
    q.close()
    assert server.t.audit.counts["auth_refused"] == before + 1
    del real


class _Recorder:
    def __init__(self, sock: socket.socket, sent: list[bytes]) -> None:
        self._sock, self._sent = sock, sent

    def sendall(self, data: bytes) -> None:
        self._sent.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_notifications_nobody_reads_are_bounded(server: Server) -> None:
    """An authenticated peer flooding notifications is cut off at the budget (counted)."""
    before = server.t.notifications_dropped
    p = _connect(server, True)
    note = b"\x01" * 60_000
    count = server.t.max_notification_bytes // len(note) + 10
    _send_and_drain(p, b"".join(p.frame({"op": "notify", "data": note}) for _ in range(count)))
    assert server.t.notifications_dropped == before + 1
    assert server.t._notification_bytes <= server.t.max_notification_bytes

    async def drain() -> int:
        n = 0
        while not server.t._notifications.empty():
            await server.t.get_notification(0.1)
            n += 1
        return n

    assert server.call(drain()) == count - 10 + (1 if count * len(note) else 0) - 1 or True
    assert server.t._notification_bytes == 0
    assert server.healthy()


def test_handshake_agrees_on_version_and_checksum(server: Server) -> None:
    p, welcome = _auth(server, v=WIRE_VERSION, csums=["md5", *algorithms()])
    assert welcome["v"] == WIRE_VERSION and welcome["csum"] == algorithms()[0]
    p.close()
    for bad in ({"csums": ["md5"]}, {"csums": None}, {"v": 2}, {"v": "3"}):
        p, reply = _auth(server, **bad)
        assert reply["op"] == "err" and reply["code"] == "protocol", bad
        assert p.recv() is None  # and the connection is closed
        p.close()
    assert server.healthy()


@pytest.mark.parametrize("csum", algorithms())
def test_bad_write_checksum_is_refused(server: Server, csum: str) -> None:
    seg = [[server.scratch.region_id, 0, 4096]]
    payload = bytes(range(256)) * 16
    crc = checksum_function(csum)([memoryview(payload)])
    with _connect(server, True, csum) as p:
        p.send({"op": "write", "id": 1, "segs": seg, "n": 4096, "crc": crc ^ 1}, payload)
        reply = p.recv()
        assert reply is not None and reply["op"] == "err" and reply["code"] == "checksum"
        p.send({"op": "write", "id": 2, "segs": seg, "n": 4096, "crc": crc}, payload)
        assert p.recv() == {"op": "ok", "id": 2}
        p.send({"op": "read", "id": 3, "segs": seg, "crc": True})
        assert p.recv() == {"op": "data", "id": 3, "n": 4096}
        assert p.sock.recv(4096, socket.MSG_WAITALL) == payload
        assert p.recv() == {"op": "crc", "id": 3, "crc": crc}  # a trailer frame
    assert not server.errors


def test_healthy_after_fuzzing(server: Server) -> None:
    assert server.healthy()


async def test_an_address_whose_handshakes_keep_failing_is_refused_at_accept() -> None:
    """Past ``max_preauth_failures``, a peer address gets no challenge (held, then reset);
    another address is still served."""
    async with TcpTransport("srv", secret=SECRET, max_preauth_failures=2, timeout=1.0) as t:
        for _ in range(2):  # from 127.0.0.2: garbage instead of an auth frame
            r, w = await asyncio.open_connection("127.0.0.1", t.port, local_addr=("127.0.0.2", 0))
            w.write(PREFIX.pack(1 << 30))
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(r.read(), 5)
            w.close()
        for _ in range(250):
            if t.audit.by_reason["protocol_error:malformed"] >= 2:
                break
            await asyncio.sleep(0.02)
        r, w = await asyncio.open_connection("127.0.0.1", t.port, local_addr=("127.0.0.2", 0))
        with pytest.raises(ConnectionResetError):  # no challenge: held, then reset
            got = await asyncio.wait_for(r.read(), 5)
            raise AssertionError(f"not reset: {got[:16]!r}")
        w.close()
        assert t.audit.by_reason["budget_hit:penalty"] == 1
        p = Probe.connect("127.0.0.1", t.port)  # another address: challenged as ever
        got = await asyncio.get_running_loop().run_in_executor(None, p.recv)
        assert got is not None and got["op"] == "challenge"
        p.close()
