"""The nixl transport against real peer processes (NIXL's UCX backend on host memory).

Skipped when NIXL is not installed (``pip install --no-deps nixl-cu12``).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import zlib
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest

from transports import (
    ClosedError,
    PeerError,
    RegionDescriptor,
    RegionError,
    RemoteAccessError,
    TransferOp,
    TransferTimeoutError,
    TransportError,
    create,
)

PAGE = 16 << 10
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_nixl(request: pytest.FixtureRequest) -> None:
    if request.node.name.startswith("test_missing_nixl"):
        return
    try:
        from transports.nixl import load_nixl

        load_nixl()
    except TransportError:
        pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu12)")


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """UCX over TCP for this test's agents and peers (so a transfer takes long enough to be
    interrupted; cross-memory attach would finish inside the post)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    yield


class Peer:
    """A nixl_peer_proc.py child: metadata, first region's descriptor, a command channel."""

    def __init__(self, proc: asyncio.subprocess.Process, meta: bytes, desc: RegionDescriptor):
        self.proc, self.meta, self.desc = proc, meta, desc

    async def ask(self, command: str, timeout: float = 10.0) -> list[str]:
        """Send one command; the words of the reply (lines that are not replies are skipped)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._reply(("NOTE", "DESC"), timeout)

    async def _reply(self, words: tuple[str, ...], timeout: float) -> list[str]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.proc.stdout.readline()).decode().split()
                if not line and self.proc.stdout.at_eof():
                    raise AssertionError("peer exited")
                if line and line[0] in words:
                    return line


@asynccontextmanager
async def spawn(size: int, seed: int) -> AsyncIterator[Peer]:
    """Start a peer with one seeded region; kill and reap it on exit."""
    script = Path(__file__).with_name("nixl_peer_proc.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "ERROR"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(size), str(seed),
        stdin=PIPE, stdout=PIPE, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        peer = Peer(proc, b"", RegionDescriptor("", 0, 0))
        words = await peer._reply(("READY",), 30.0)
        peer.meta, peer.desc = (
            bytes.fromhex(words[1]),
            RegionDescriptor.unpack(bytes.fromhex(words[2])),
        )
        yield peer
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10.0)


def seeded(size: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(size))


def pages(view: memoryview | bytearray, index: int) -> bytes:
    return bytes(view[index * PAGE : (index + 1) * PAGE])


async def test_two_processes_bit_exact_late_region_and_notes_in_order() -> None:
    size = 4 << 20
    async with spawn(size, seed=7) as peer, create("nixl", timeout=10.0) as t:
        expected = seeded(size, 7)
        assert await t.add_peer(peer.meta) == peer.desc.agent
        mine = t.allocate(size)
        src = random.Random(2).sample(range(size // PAGE), 200)
        await t.read(
            [TransferOp(mine, i * PAGE, peer.desc, s * PAGE, PAGE) for i, s in enumerate(src)]
        )
        assert all(pages(mine.view, i) == pages(expected, s) for i, s in enumerate(src))

        # a region the peer registered after its metadata went out: the descriptor carries it
        words = await peer.ask(f"region {64 * PAGE} 11")
        late = RegionDescriptor.unpack(bytes.fromhex(words[1]))
        await t.read([TransferOp(mine, 0, late, 5 * PAGE, 3 * PAGE)])
        assert bytes(mine.view[: 3 * PAGE]) == bytes(seeded(64 * PAGE, 11)[5 * PAGE : 8 * PAGE])

        # each notification arrives after its batch's bytes (the crc the peer sees), in order
        states = []
        for k, note in enumerate((b"first", b"second", b"")):
            mine.view[: 2 * PAGE] = os.urandom(2 * PAGE)
            dst = [10 + k, 40 + 3 * k]
            await t.write(
                [TransferOp(mine, i * PAGE, peer.desc, d * PAGE, PAGE) for i, d in enumerate(dst)],
                notify=note,
            )
            for i, d in enumerate(dst):
                expected[d * PAGE : (d + 1) * PAGE] = pages(mine.view, i)
            states.append(zlib.crc32(expected))
        for note, crc in zip((b"first", b"second", b""), states, strict=True):
            reply = await peer.ask("note")
            assert reply[1] == (note.hex() or "-")
            assert int(reply[2]) in states[states.index(crc) :]  # never earlier than its batch
        # read notifications too
        await t.read([TransferOp(mine, 0, peer.desc, 0, PAGE)], notify=b"read")
        assert (await peer.ask("note"))[1:] == [b"read".hex(), str(states[-1])]


async def test_three_processes_one_batch() -> None:
    size = 2 << 20
    async with (
        spawn(size, seed=1) as p1,
        spawn(size, seed=2) as p2,
        create("nixl", timeout=10.0) as t,
    ):
        await t.add_peer(p1.meta)
        await t.add_peer(p2.meta)
        e1, e2 = seeded(size, 1), seeded(size, 2)
        mine = t.allocate(2 * size)
        rng = random.Random(3)
        plan = [(rng.choice((p1, p2)), rng.randrange(size // PAGE)) for _ in range(128)]
        ops = [TransferOp(mine, i * PAGE, p.desc, s * PAGE, PAGE) for i, (p, s) in enumerate(plan)]
        await t.read(ops)
        for i, (p, s) in enumerate(plan):
            assert pages(mine.view, i) == pages(e1 if p is p1 else e2, s)

        mine.view[: 4 * PAGE] = os.urandom(4 * PAGE)
        writes = [
            TransferOp(mine, i * PAGE, (p1, p2)[i % 2].desc, i * PAGE, PAGE) for i in range(4)
        ]
        await t.write(writes, notify=b"both")
        for i in range(4):
            (e1, e2)[i % 2][i * PAGE : (i + 1) * PAGE] = pages(mine.view, i)
        assert await p1.ask("note") == ["NOTE", b"both".hex(), str(zlib.crc32(e1))]
        assert await p2.ask("note") == ["NOTE", b"both".hex(), str(zlib.crc32(e2))]


async def test_bad_input_is_refused_and_close_releases() -> None:
    async with create("nixl", timeout=10.0) as a, create("nixl", timeout=10.0) as b:
        theirs = b.allocate(1 << 20)
        theirs.view[:] = os.urandom(1 << 20)
        mine = a.allocate(1 << 20)
        stranger = RegionDescriptor("nobody", 1, 1 << 20, "host", theirs.descriptor.handle)
        with pytest.raises(PeerError):
            a.read([TransferOp(mine, 0, stranger, 0, PAGE)])
        for meta in (b"\xc1", msgpack.packb({"transport": "shm", "agent": "x"})):
            with pytest.raises(PeerError):
                await a.add_peer(meta)
        with pytest.raises(PeerError):
            await a.add_peer(msgpack.packb({"transport": "nixl", "agent": "x", "nixl": b"junk"}))
        await a.add_peer(b.metadata())

        d = theirs.descriptor
        bad = [
            RegionDescriptor(d.agent, d.region_id, 2 << 20, d.kind, d.handle),  # forged size
            RegionDescriptor(d.agent, d.region_id, d.size, d.kind, "tkv-0123"),  # shm handle
            RegionDescriptor(d.agent, d.region_id, d.size, d.kind, "1:0:DRAM:zz"),
        ]
        for desc in bad:
            with pytest.raises(RemoteAccessError):
                await a.read(
                    [TransferOp(mine, 0, desc, (1 << 20) - PAGE + 1 if desc is bad[0] else 0, PAGE)]
                )
        with pytest.raises(RemoteAccessError):  # outside the descriptor: refused at once
            a.read([TransferOp(mine, 0, d, (1 << 20) - 1, 2)])
        with pytest.raises(RegionError):
            a.read([TransferOp(mine, (1 << 20) - 1, d, 0, 2)])
        with pytest.raises(RegionError):
            a.register_memory(bytearray(16), "device")  # not a CUDA buffer
        with pytest.raises(RegionError):
            a.register_memory(b"read-only")

        # still healthy after the refusals: a good read, bit-exact, and a zero-length op
        await a.read([TransferOp(mine, 0, d, 3 * PAGE, PAGE), TransferOp(mine, 0, d, 0, 0)])
        assert pages(mine.view, 0) == pages(theirs.view, 3)
        gone = a.allocate(PAGE)
        a.deregister(gone)
        with pytest.raises(RegionError):
            a.read([TransferOp(gone, 0, d, 0, PAGE)])
    assert a.closed and a._agent is None and not a._reg  # every registration released
    with pytest.raises(ClosedError):
        a.allocate(16)


async def test_peer_killed_mid_transfer(tcp_only: None) -> None:
    size = 32 << 20
    async with spawn(size, seed=5) as peer, create("nixl", timeout=15.0) as t:
        await t.add_peer(peer.meta)
        mine = t.allocate(size + PAGE)
        before = np.frombuffer(os.urandom(size + PAGE), np.uint8)
        np.frombuffer(mine.view, np.uint8)[:] = before
        theirs = np.frombuffer(seeded(size, 5), np.uint8)
        ops = [TransferOp(mine, i * PAGE, peer.desc, i * PAGE, PAGE) for i in range(size // PAGE)]
        error: BaseException | None = None
        for attempt in range(5):  # the first read is normally cut short; later ones must fail
            handle = t.read(ops)
            if attempt == 0:
                await asyncio.sleep(0.01)
                peer.proc.kill()
            try:
                await handle
            except PeerError as exc:
                error = exc
                break
        assert isinstance(error, PeerError)
        now = np.frombuffer(mine.view, np.uint8)
        # every byte is either what was there or the peer's byte at that place; the page past
        # the batch is untouched
        assert np.all((now[:size] == before[:size]) | (now[:size] == theirs))
        assert np.array_equal(now[size:], before[size:])
        del now


async def test_stalled_peer_times_out(tcp_only: None) -> None:
    async with spawn(8 << 20, seed=6) as peer, create("nixl", timeout=2.0) as t:
        await t.add_peer(peer.meta)
        mine = t.allocate(8 << 20)
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            h = t.read([TransferOp(mine, 0, peer.desc, 0, 8 << 20)])
            with pytest.raises(TransferTimeoutError):
                await h.wait(timeout=10.0)  # the transfer's own 2 s deadline fires first
        finally:
            peer.proc.send_signal(signal.SIGCONT)
        await t.read([TransferOp(mine, 0, peer.desc, PAGE, PAGE)])  # the peer is back
        assert pages(mine.view, 0) == pages(seeded(8 << 20, 6), 1)


async def test_missing_nixl_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    with pytest.raises(TransportError, match="pip install --no-deps nixl-cu12"):
        create("nixl")
