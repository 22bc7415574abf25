"""The tcp transport: in one process, against peers in other processes, and against bad frames."""

from __future__ import annotations

import os
import random
import signal
import zlib
from typing import Any

import pytest

from transports import (
    AuthError,
    PeerError,
    RegionDescriptor,
    RemoteAccessError,
    TransferOp,
    TransferTimeoutError,
)
from transports.tcp import TcpTransport

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
