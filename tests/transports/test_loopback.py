"""The base-class contract, exercised through the loopback transport (same process)."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from tierkv.transports import (
    ClosedError,
    PeerError,
    RegionDescriptor,
    RegionError,
    RemoteAccessError,
    TransferOp,
    TransferTimeoutError,
    create,
)
from tierkv.transports.crc32c_native import crc32c
from tierkv.transports.loopback import LoopbackTransport


async def test_batch_read_write_bit_exact() -> None:
    async with LoopbackTransport("a") as a, LoopbackTransport("b") as b:
        src = bytearray(os.urandom(1 << 20))
        theirs = b.register_memory(src)
        mine = a.allocate(1 << 20)
        assert await a.add_peer(b.metadata()) == "b"
        pages = list(range(0, 1 << 20, 4096))[::-1]  # 256 ops, reversed order
        ops = [TransferOp(mine, i, theirs.descriptor, p, 4096) for i, p in zip(pages[::-1], pages)]
        await a.read(ops)
        for i, p in zip(pages[::-1], pages):
            assert mine.view[i : i + 4096] == src[p : p + 4096]
        mine.view[:] = os.urandom(1 << 20)
        await a.write([TransferOp(mine, 0, theirs.descriptor, 0, 1 << 20)], notify=b"w1")
        assert bytes(src) == bytes(mine.view)
        note = await b.get_notification(timeout=1)
        assert note == ("a", b"w1")


async def test_a_read_with_checksums_reports_each_ops_crc32c_as_landed() -> None:
    async with LoopbackTransport("c1") as a, LoopbackTransport("c2") as b:
        src = bytearray(os.urandom(1 << 16))
        theirs = b.register_memory(src)
        mine = a.allocate(1 << 16)
        await a.add_peer(b.metadata())
        ops = [
            TransferOp(mine, i, theirs.descriptor, (1 << 16) - 4096 - i, 4096) for i in (0, 8192)
        ]
        handle = a.read(ops, checksums=True)
        await handle
        assert handle.sums == [crc32c(src[(1 << 16) - 4096 - i :][:4096]) for i in (0, 8192)]
        plain = a.read(ops)
        await plain
        assert plain.sums is None


async def test_descriptor_round_trip() -> None:
    async with LoopbackTransport() as t:
        desc = t.allocate(100).descriptor
        assert RegionDescriptor.unpack(desc.pack()) == desc
        assert RegionDescriptor.from_wire(msgpack.unpackb(msgpack.packb(desc.to_wire()))) == desc
        with pytest.raises(RegionError):
            RegionDescriptor.unpack(b"\x93\x01\x02\x03")
        with pytest.raises(RegionError):
            RegionDescriptor.from_wire(["a", 1, -5, "host", ""])


async def test_validation_errors_raise_at_post() -> None:
    async with LoopbackTransport("v1") as a, LoopbackTransport("v2") as b:
        mine, theirs = a.allocate(64), b.allocate(64)
        ghost = RegionDescriptor("nobody", 1, 64)
        with pytest.raises(PeerError):
            a.read([TransferOp(mine, 0, theirs.descriptor, 0, 8)])
        await a.add_peer(b.metadata())
        with pytest.raises(RegionError):
            a.read([TransferOp(mine, 60, theirs.descriptor, 0, 8)])
        with pytest.raises(RegionError):  # a region of another transport
            a.read([TransferOp(theirs, 0, theirs.descriptor, 0, 8)])
        with pytest.raises(RemoteAccessError):
            a.read([TransferOp(mine, 0, theirs.descriptor, 60, 8)])
        with pytest.raises(PeerError):
            a.read([TransferOp(mine, 0, ghost, 0, 8)])
        with pytest.raises(RegionError):
            a.register_memory(b"read-only")
        with pytest.raises(RegionError):
            a.register_memory(bytearray(8), kind="device")
        with pytest.raises(PeerError):
            await a.add_peer(b"\xc1garbage")
        with pytest.raises(PeerError):
            await a.add_peer(msgpack.packb({"transport": "tcp", "agent": "x"}))


async def test_remote_checks_against_the_real_region() -> None:
    async with LoopbackTransport("r1") as a, LoopbackTransport("r2") as b:
        mine, theirs = a.allocate(64), b.allocate(64)
        await a.add_peer(b.metadata())
        forged = RegionDescriptor("r2", theirs.region_id, 1 << 20)
        with pytest.raises(RemoteAccessError):
            await a.read([TransferOp(mine, 0, forged, 100, 8)])
        b.deregister(theirs)
        with pytest.raises(RemoteAccessError):
            await a.read([TransferOp(mine, 0, theirs.descriptor, 0, 8)])
        with pytest.raises(RegionError):
            b.deregister(theirs)


async def test_closed_and_timeouts() -> None:
    a = await LoopbackTransport("c1").start()
    with pytest.raises(TransferTimeoutError):
        await a.get_notification(timeout=0.01)
    assert isinstance(TransferTimeoutError("x"), TimeoutError)
    await a.aclose()
    await a.aclose()
    with pytest.raises(ClosedError):
        a.allocate(8)
    with pytest.raises(ClosedError):
        await a.start()


async def test_peer_gone_is_typed() -> None:
    a = await LoopbackTransport("g1").start()
    b = await LoopbackTransport("g2").start()
    mine, theirs = a.allocate(64), b.allocate(64)
    await a.add_peer(b.metadata())
    await b.aclose()
    with pytest.raises(PeerError):
        await a.read([TransferOp(mine, 0, theirs.descriptor, 0, 8)])
    await a.aclose()


async def test_cancelled_await_does_not_stop_the_transfer() -> None:
    async with LoopbackTransport("w1") as a, LoopbackTransport("w2") as b:
        mine, theirs = a.allocate(64), b.register_memory(bytearray(b"x" * 64))
        await a.add_peer(b.metadata())
        h = a.read([TransferOp(mine, 0, theirs.descriptor, 0, 64)])
        waiter = asyncio.ensure_future(h.wait())
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await h
        assert h.done() and h.exception() is None
        assert bytes(mine.view) == b"x" * 64


async def test_registry_builtin() -> None:
    t = create("loopback", name="reg")
    assert isinstance(t, LoopbackTransport)
    assert t.capabilities.one_sided == "native"
    async with t:
        assert t.metadata()


async def test_peer_bytes_over_the_decode_limits_are_typed_errors() -> None:
    """Metadata and descriptors are a peer's bytes: decoded within explicit limits."""
    async with LoopbackTransport("lim") as a:
        huge_array = b"\xdd" + (1 << 24).to_bytes(4, "big")  # array32 claiming 16M items
        for data in (
            huge_array,
            msgpack.packb({"agent": "x", "pad": [0] * 300}),  # an array over 256
            msgpack.packb({"agent": "x", "pad": b"\0" * (1 << 20)}),  # over 1 MiB in all
            msgpack.packb(msgpack.ExtType(1, b"x")),  # no ext types
        ):
            with pytest.raises(PeerError, match="malformed peer metadata"):
                await a.add_peer(data)
        for data in (huge_array, msgpack.packb(["a" * 5000, 1, 2, "host", ""]), b"\0" * 70_000):
            with pytest.raises(RegionError, match="malformed region descriptor"):
                RegionDescriptor.unpack(data)


class _DeafLoopback(LoopbackTransport):
    """A transport whose serving does not stop (a handler that ignores its cancel) until let
    go."""

    gate: asyncio.Event

    async def _close(self) -> None:
        await super()._close()
        while not self.gate.is_set():
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                continue


async def test_a_close_whose_serving_does_not_stop_is_bounded_and_drops_everything() -> None:
    """Fails on the old code: aclose waited in asyncio.wait_for for the cancel to land (for
    ever), and on a plain timeout raised a builtin TimeoutError with its regions kept."""
    t = _DeafLoopback("deaf", timeout=0.2)
    t.gate = asyncio.Event()
    await t.start()
    region = t.allocate(4096)
    closing = asyncio.ensure_future(t.aclose())
    done, _ = await asyncio.wait([closing], timeout=10)
    t.gate.set()
    assert done, "aclose waited for serving that did not stop"
    with pytest.raises(TransferTimeoutError, match=r"did not stop within 0\.2 s"):
        closing.result()
    assert t.closed
    with pytest.raises(RemoteAccessError, match="has no region"):
        t.serve_view(region.region_id, 0, 1)  # dropped all the same
    await t.aclose()  # idempotent
