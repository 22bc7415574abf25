"""The shm transport: in one process, and against a peer in another process."""

from __future__ import annotations

import asyncio
import os
import random
import zlib
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import pytest

from transports import PeerError, RegionDescriptor, RemoteAccessError, TransferOp
from transports.shm import ShmTransport

PAGE = 16 << 10


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _pages(rng: random.Random, size: int, count: int) -> list[int]:
    return rng.sample(range(size // PAGE), count)


async def test_in_process_batches_notify_and_cleanup() -> None:
    async with ShmTransport("s1") as a, ShmTransport("s2") as b:
        theirs = b.allocate(1 << 20)
        theirs.view[:] = os.urandom(1 << 20)
        mine = a.register_memory(bytearray(1 << 20))  # local-only is fine as a local side
        await a.add_peer(b.metadata())
        src, dst = _pages(random.Random(1), 1 << 20, 64), list(range(64))
        ops = [
            TransferOp(mine, d * PAGE, theirs.descriptor, s * PAGE, PAGE) for s, d in zip(src, dst)
        ]
        await a.read(ops, notify=b"read done")
        for s, d in zip(src, dst):
            assert mine.view[d * PAGE : (d + 1) * PAGE] == theirs.view[s * PAGE : (s + 1) * PAGE]
        assert await b.get_notification(1) == ("s1", b"read done")
        mine.view[:PAGE] = b"\x5a" * PAGE
        await a.write([TransferOp(mine, 0, theirs.descriptor, 7 * PAGE, PAGE)])
        assert theirs.view[7 * PAGE : 8 * PAGE] == b"\x5a" * PAGE
        handle = theirs.descriptor.handle
        assert _segment_exists(handle)
        b.deregister(theirs)
        assert not _segment_exists(handle)
        # the announcement reaches `a` asynchronously; then its cached mapping is dropped
        for _ in range(500):
            try:
                await a.read(ops[:1])
            except RemoteAccessError:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("deregistration never reached the peer")
        kept = b.allocate(4096)
    assert not _segment_exists(kept.descriptor.handle)


async def test_refuses_what_it_cannot_map() -> None:
    async with ShmTransport("m1") as a, ShmTransport("m2") as b:
        mine = a.allocate(4096)
        local_only = b.register_memory(bytearray(4096))
        await a.add_peer(b.metadata())
        for desc in (
            local_only.descriptor,
            RegionDescriptor("m2", 99, 4096, "host", "../etc/passwd"),
            RegionDescriptor("m2", 98, 4096, "host", "tkv-does-not-exist"),
        ):
            with pytest.raises(RemoteAccessError):
                await a.read([TransferOp(mine, 0, desc, 0, 4096)])
        small = b.allocate(100)
        forged = RegionDescriptor("m2", small.region_id, 1 << 20, "host", small.descriptor.handle)
        with pytest.raises(RemoteAccessError):
            await a.read([TransferOp(mine, 0, forged, 0, 4096)])


async def test_callers_shared_memory_stays_theirs() -> None:
    seg = SharedMemory(create=True, size=8192)
    try:
        async with ShmTransport("u1") as a, ShmTransport("u2") as b:
            theirs = b.register_memory(seg)
            mine = a.allocate(8192)
            mine.view[:] = b"\x01" * 8192
            await a.add_peer(b.metadata())
            await a.write([TransferOp(mine, 0, theirs.descriptor, 0, 8192)])
        assert seg.buf is not None and bytes(seg.buf[:8192]) == b"\x01" * 8192
    finally:
        seg.close()
        seg.unlink()


async def test_two_processes(peer_process: Any) -> None:
    size = 4 << 20
    async with peer_process("shm", size, seed=7) as peer, ShmTransport() as t:
        expected = bytearray(random.Random(7).randbytes(size))
        assert await t.add_peer(peer.meta) == peer.desc.agent
        mine = t.allocate(size)
        src = _pages(random.Random(2), size, 200)
        ops = [TransferOp(mine, i * PAGE, peer.desc, s * PAGE, PAGE) for i, s in enumerate(src)]
        await t.read(ops)
        for i, s in enumerate(src):
            assert mine.view[i * PAGE : (i + 1) * PAGE] == expected[s * PAGE : (s + 1) * PAGE]
        mine.view[: 3 * PAGE] = os.urandom(3 * PAGE)
        writes = [
            TransferOp(mine, i * PAGE, peer.desc, (10 + 5 * i) * PAGE, PAGE) for i in range(3)
        ]
        await t.write(writes, notify=b"landed")
        for i in range(3):
            expected[(10 + 5 * i) * PAGE : (11 + 5 * i) * PAGE] = mine.view[
                i * PAGE : (i + 1) * PAGE
            ]
        assert await peer.ask("note") == ["NOTE", b"landed".hex(), str(zlib.crc32(expected))]

        peer.proc.kill()
        await peer.proc.wait()
        with pytest.raises(PeerError):
            await t.read(ops)
