"""The tcp transport: in one process, against peers in other processes, and against bad frames;
its checksums (negotiation, corruption detected both ways; the algorithms: test_checksum.py)."""

from __future__ import annotations

import os
import random
import signal
import zlib
from typing import Any

import pytest

from tierkv.transports import (
    AuthError,
    ChecksumError,
    PeerError,
    RegionDescriptor,
    RemoteAccessError,
    TransferOp,
    TransferTimeoutError,
)
from tierkv.transports.checksum import algorithms
from tierkv.transports.tcp import ClientConnection, TcpTransport
from tierkv.transports.tcp_server import ServerConnection

SECRET = b"s3cret"
PAGE = 16 << 10


@pytest.mark.parametrize("checksum", [True, False])
async def test_many_ops_bit_exact_with_small_chunks(checksum: bool) -> None:
    kw: dict[str, Any] = {"secret": SECRET, "chunk_bytes": 100_000, "checksum": checksum}
    async with TcpTransport("t1", **kw) as a, TcpTransport("t2", **kw) as b:
        size = 2 << 20
        theirs = b.register_memory(bytearray(os.urandom(size)))
        mine = a.allocate(size)
        assert await a.add_peer(b.metadata()) == "t2"
        rng = random.Random(3)
        ops, at = [], 0
        for _ in range(400):  # random sizes, some crossing chunk boundaries, some empty
            n = rng.choice([0, 1, 4096, 77_777, 130_000])
            if at + n > size:
                break
            ops.append(TransferOp(mine, at, theirs.descriptor, rng.randrange(size - n + 1), n))
            at += n
        await a.read(ops, notify=b"r")
        for op in ops:
            got = mine.view[op.local_offset : op.local_offset + op.length]
            assert got == theirs.view[op.remote_offset : op.remote_offset + op.length]
        assert await b.get_notification(5) == ("t1", b"r")
        mine.view[:] = os.urandom(size)
        await a.write([TransferOp(mine, 0, theirs.descriptor, 0, size)], notify=b"w")
        assert await b.get_notification(5) == ("t1", b"w")
        assert bytes(theirs.view) == bytes(mine.view)


async def test_refusals_keep_the_connection() -> None:
    async with TcpTransport("o1", secret=SECRET) as a, TcpTransport("o2", secret=SECRET) as b:
        theirs = b.register_memory(bytearray(b"\x07" * 4096))
        mine = a.allocate(8192)
        await a.add_peer(b.metadata())
        forged = RegionDescriptor("o2", theirs.region_id, 1 << 30)
        unknown = RegionDescriptor("o2", 999, 4096)
        for desc in (forged, unknown):
            with pytest.raises(RemoteAccessError):
                await a.read([TransferOp(mine, 0, desc, 4096, 4096)])
            with pytest.raises(RemoteAccessError):
                await a.write([TransferOp(mine, 0, desc, 4096, 4096)])
        assert bytes(theirs.view) == b"\x07" * 4096
        await a.read([TransferOp(mine, 0, theirs.descriptor, 0, 4096)])
        assert bytes(mine.view[:4096]) == b"\x07" * 4096


async def test_a_read_guard_refuses_what_it_does_not_let_in_and_keeps_the_connection() -> None:
    async with TcpTransport("g1", secret=SECRET) as a, TcpTransport("g2", secret=SECRET) as b:
        theirs = b.register_memory(bytearray(bytes(range(256)) * 32))  # 8 KiB
        mine = a.allocate(8192)
        await a.add_peer(b.metadata())
        asked: list[tuple[str, int, int, int]] = []

        def first_half(agent: str, rid: int, offset: int, length: int) -> bool:
            asked.append((agent, rid, offset, length))
            return offset + length <= 4096

        b.guard_reads(first_half)
        with pytest.raises(RemoteAccessError, match="not ours to read"):
            await a.read([TransferOp(mine, 0, theirs.descriptor, 2048, 4096)])
        assert not any(mine.view)  # nothing of the refused read was sent
        await a.read([TransferOp(mine, 0, theirs.descriptor, 0, 4096)], checksums=True)
        assert bytes(mine.view[:4096]) == bytes(theirs.view[:4096])
        assert asked == [("g1", theirs.region_id, 2048, 4096), ("g1", theirs.region_id, 0, 4096)]
        await a.write([TransferOp(mine, 0, theirs.descriptor, 4096, 4096)])  # writes: not asked
        assert len(asked) == 2
        b.guard_reads(None)
        await a.read([TransferOp(mine, 4096, theirs.descriptor, 4096, 4096)])
        assert bytes(mine.view) == bytes(theirs.view)


async def test_wrong_secret_is_refused() -> None:
    async with TcpTransport("k1", secret=b"wrong") as a, TcpTransport("k2", secret=SECRET) as b:
        with pytest.raises(AuthError):
            await a.add_peer(b.metadata())
        async with TcpTransport("k3", secret=SECRET) as c:
            await c.add_peer(b.metadata())
        with pytest.raises(ValueError):
            TcpTransport(secret=None)


async def test_two_processes_and_peer_death(peer_process: Any) -> None:
    size = 4 << 20
    async with (
        peer_process("tcp", size, seed=11, secret=SECRET) as peer,
        TcpTransport(secret=SECRET, timeout=5.0) as t,
    ):
        expected = bytearray(random.Random(11).randbytes(size))
        await t.add_peer(peer.meta)
        mine = t.allocate(size)
        src = random.Random(4).sample(range(size // PAGE), 200)
        ops = [TransferOp(mine, i * PAGE, peer.desc, s * PAGE, PAGE) for i, s in enumerate(src)]
        await t.read(ops)
        for i, s in enumerate(src):
            assert mine.view[i * PAGE : (i + 1) * PAGE] == expected[s * PAGE : (s + 1) * PAGE]
        mine.view[:PAGE] = os.urandom(PAGE)
        await t.write([TransferOp(mine, 0, peer.desc, 5 * PAGE, PAGE)], notify=b"ok")
        expected[5 * PAGE : 6 * PAGE] = mine.view[:PAGE]
        assert await peer.ask("note") == ["NOTE", b"ok".hex(), str(zlib.crc32(expected))]
        peer.proc.kill()
        await peer.proc.wait()
        with pytest.raises(PeerError):
            await t.read(ops)


async def test_stalled_peer_times_out(peer_process: Any) -> None:
    async with (
        peer_process("tcp", 1 << 20, seed=1, secret=SECRET) as peer,
        TcpTransport(secret=SECRET, timeout=0.5) as t,
    ):
        await t.add_peer(peer.meta)
        mine = t.allocate(1 << 20)
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            h = t.read([TransferOp(mine, 0, peer.desc, 0, 1 << 20)])
            with pytest.raises(TransferTimeoutError):
                await h.wait(timeout=5.0)  # the transfer's own 0.5 s deadline fires first
        finally:
            peer.proc.send_signal(signal.SIGCONT)


async def test_peer_killed_mid_transfer(script_process: Any) -> None:
    async with (
        script_process("dying_server.py", SECRET.hex()) as peer,
        TcpTransport(secret=SECRET, timeout=5.0) as t,
    ):
        await t.add_peer(peer.meta)
        mine = t.allocate(1 << 20)
        mine.view[:] = b"\x00" * (1 << 20)
        remote = RegionDescriptor("dying", 1, 1 << 20)
        with pytest.raises(PeerError):
            await t.read([TransferOp(mine, 0, remote, 0, 1 << 20)])
        # what landed is the half the peer sent before dying; nothing lands afterwards
        landed = bytes(mine.view).rstrip(b"\x00")
        assert set(landed) <= {0xEE} and len(landed) <= 1 << 19


# -- checksums -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [False, True])
async def test_checksummed_transfers_with_and_without_the_thread(threads: bool) -> None:
    kw: dict[str, Any] = {"secret": SECRET, "chunk_bytes": 1 << 20, "checksum_thread": threads}
    async with TcpTransport("h1", **kw) as a, TcpTransport("h2", **kw) as b:
        size = 6 << 20  # chunks above the inline threshold: the thread (if any) computes them
        theirs = b.register_memory(bytearray(os.urandom(size)))
        mine = a.allocate(size)
        await a.add_peer(b.metadata())
        assert a._conns["h2"].csum_name == algorithms()[0]
        await a.read([TransferOp(mine, 0, theirs.descriptor, 0, size)])
        assert bytes(mine.view) == bytes(theirs.view)
        mine.view[:] = os.urandom(size)
        await a.write([TransferOp(mine, 0, theirs.descriptor, 0, size)])
        assert bytes(mine.view) == bytes(theirs.view)


def _corrupting(send: Any, op: str) -> Any:
    """`send` that flips one bit in the payload of every `op` frame (a copy: memory is intact)."""

    def corrupt(self: Any, header: dict[str, Any], payload: Any = ()) -> None:
        if header["op"] == op and payload:
            payload = [bytearray(v) for v in payload]
            payload[-1][-1] ^= 0x10
        send(self, header, payload)

    return corrupt


@pytest.mark.parametrize("threads", [False, True])
async def test_corrupted_payloads_are_detected(
    threads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw: dict[str, Any] = {"secret": SECRET, "checksum_thread": threads}
    async with TcpTransport("c1", **kw) as a, TcpTransport("c2", **kw) as b:
        size = 1 << 20
        theirs = b.register_memory(bytearray(os.urandom(size)))
        original = bytes(theirs.view)
        mine = a.allocate(size)
        await a.add_peer(b.metadata())
        ops = [TransferOp(mine, 0, theirs.descriptor, 0, size)]
        with monkeypatch.context() as m:
            m.setattr(ServerConnection, "send", _corrupting(ServerConnection.send, "data"))
            with pytest.raises(ChecksumError):
                await a.read(ops)
        with monkeypatch.context() as m:
            m.setattr(ClientConnection, "send", _corrupting(ClientConnection.send, "write"))
            with pytest.raises(ChecksumError):
                await a.write(ops)
        # the stream stayed in step: the same connection serves intact payloads again
        theirs.view[:] = original
        await a.read(ops)
        assert bytes(mine.view) == original


async def test_checksum_negotiation_falls_back_to_crc32(
    peer_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERKV_NATIVE_CHECKSUM", "0")  # the peer process lacks the helper
    size = 1 << 20
    async with (
        peer_process("tcp", size, seed=3, secret=SECRET) as peer,
        TcpTransport(secret=SECRET, timeout=5.0) as t,
    ):
        await t.add_peer(peer.meta)
        conn = t._conns[peer.desc.agent]
        assert conn.csum_name == "crc32"
        mine = t.allocate(size)
        await t.read([TransferOp(mine, 0, peer.desc, 0, size)])
        assert bytes(mine.view) == random.Random(3).randbytes(size)
    with monkeypatch.context() as m:  # and in-process: a client offering crc32 only
        m.setattr("tierkv.transports.tcp.algorithms", lambda: ("crc32",))
        async with TcpTransport("n1", secret=SECRET) as a, TcpTransport("n2", secret=SECRET) as b:
            await a.add_peer(b.metadata())
            assert a._conns["n2"].csum_name == "crc32"


async def test_an_older_wire_version_is_refused_not_downgraded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 3 tags every header: a peer of an older version would talk untagged, so it is
    refused rather than downgraded to."""
    monkeypatch.setattr("tierkv.transports.tcp.WIRE_VERSION", 2)  # our client speaks version 2
    async with TcpTransport("v2", secret=SECRET) as a, TcpTransport("v3", secret=SECRET) as b:
        with pytest.raises(AuthError, match="wire version"):
            await a.add_peer(b.metadata())
