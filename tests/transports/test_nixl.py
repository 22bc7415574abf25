"""The nixl transport against real peer processes (NIXL's UCX backend on host memory).

Skipped when NIXL is not installed (``pip install --no-deps nixl-cu12``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import zlib
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tierkv.transports import (
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
        from tierkv.transports.nixl import load_nixl

        load_nixl()
    except TransportError:
        pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu12)")


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """UCX over TCP for this test's agents and peers (so a transfer takes long enough to be
    interrupted; cross-memory attach would finish inside the post)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    yield


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return all(st in ("T", "t") for st in states)


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


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `condition` (an asynchronous announcement arriving) for at most `timeout` s."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not so after {timeout:g} s")


def seeded(size: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(size))


def pages(view: memoryview | bytearray, index: int) -> bytes:
    return bytes(view[index * PAGE : (index + 1) * PAGE])


async def test_two_and_three_processes_bit_exact_notes_in_order() -> None:
    size = 2 << 20
    async with contextlib.AsyncExitStack() as stack:
        p1, p2, t = await asyncio.gather(  # start-ups overlap
            stack.enter_async_context(spawn(size, seed=1)),
            stack.enter_async_context(spawn(size, seed=2)),
            stack.enter_async_context(create("nixl", timeout=10.0)),
        )
        assert await t.add_peer(p1.meta) == p1.desc.agent
        e1, e2 = seeded(size, 1), seeded(size, 2)
        mine = t.allocate(2 * size)

        # two processes: 100 random pages in one batch, bit-exact
        src = random.Random(2).sample(range(size // PAGE), 100)
        await t.read(
            [TransferOp(mine, i * PAGE, p1.desc, s * PAGE, PAGE) for i, s in enumerate(src)]
        )
        assert all(pages(mine.view, i) == pages(e1, s) for i, s in enumerate(src))

        # a region the peer registered after its metadata went out: the descriptor carries it
        words = await p1.ask(f"region {64 * PAGE} 11")
        late = RegionDescriptor.unpack(bytes.fromhex(words[1]))
        await t.read([TransferOp(mine, 0, late, 5 * PAGE, 3 * PAGE)])
        assert bytes(mine.view[: 3 * PAGE]) == bytes(seeded(64 * PAGE, 11)[5 * PAGE : 8 * PAGE])

        async def write(dst: list[int], note: bytes) -> None:
            mine.view[: len(dst) * PAGE] = os.urandom(len(dst) * PAGE)
            ops = [TransferOp(mine, i * PAGE, p1.desc, d * PAGE, PAGE) for i, d in enumerate(dst)]
            await t.write(ops, notify=note)
            for i, d in enumerate(dst):
                e1[d * PAGE : (d + 1) * PAGE] = pages(mine.view, i)

        # notifications come in posting order, each after its batch's bytes (the peer's crc)
        await write([10, 40], b"first")
        await write([11, 43], b"second")
        assert await p1.ask("note") == ["NOTE", b"first".hex(), str(zlib.crc32(e1))]
        assert (await p1.ask("note"))[1] == b"second".hex()
        await write([12], b"")  # an empty note is still a note
        assert await p1.ask("note") == ["NOTE", "-", str(zlib.crc32(e1))]
        await t.read([TransferOp(mine, 0, p1.desc, 0, PAGE)], notify=b"read")
        assert (await p1.ask("note"))[1] == b"read".hex()

        # three processes: one batch interleaving both peers' pages, then a write to both
        await t.add_peer(p2.meta)
        rng = random.Random(3)
        plan = [(rng.choice((p1, p2)), rng.randrange(size // PAGE)) for _ in range(128)]
        ops = [TransferOp(mine, i * PAGE, p.desc, s * PAGE, PAGE) for i, (p, s) in enumerate(plan)]
        await t.read(ops)
        for i, (p, s) in enumerate(plan):
            assert pages(mine.view, i) == pages(e1 if p is p1 else e2, s)
        mine.view[: 4 * PAGE] = os.urandom(4 * PAGE)
        peers = (p1, p2)
        await t.write(
            [TransferOp(mine, i * PAGE, peers[i % 2].desc, i * PAGE, PAGE) for i in range(4)],
            notify=b"both",
        )
        for i in range(4):
            (e1, e2)[i % 2][i * PAGE : (i + 1) * PAGE] = pages(mine.view, i)
        assert await p1.ask("note") == ["NOTE", b"both".hex(), str(zlib.crc32(e1))]
        assert await p2.ask("note") == ["NOTE", b"both".hex(), str(zlib.crc32(e2))]


async def test_bad_input_is_refused_and_close_releases() -> None:
    # `a` initiates only: no UCX progress thread, its engine thread drives UCX
    async with (
        create("nixl", timeout=10.0, progress_thread=False) as a,
        create("nixl", timeout=10.0) as b,
    ):
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

        # the owner announces a deregistration; the initiator then refuses the descriptor
        # (reading deregistered memory would fail the whole UCX connection)
        kept = b.allocate(PAGE)
        kept.view[:] = b"\x42" * PAGE
        await wait_until(lambda: a.name in b._engine.known)  # a's hello reached b
        b.deregister(theirs)
        await wait_until(lambda: (d.agent, d.region_id) in a._gone)
        with pytest.raises(RemoteAccessError, match="deregistered"):
            await a.read([TransferOp(mine, 0, d, 0, PAGE)])
        await a.read([TransferOp(mine, 0, kept.descriptor, 0, PAGE)])
        assert pages(mine.view, 0) == b"\x42" * PAGE
    assert a.closed and a._agent is None and not a._reg  # every registration released
    with pytest.raises(ClosedError):
        a.allocate(16)


async def test_stalled_peer_times_out_killed_peer_is_a_peer_error(tcp_only: None) -> None:
    size = 8 << 20
    async with spawn(size, seed=5) as peer, create("nixl", timeout=10.0) as t:
        await t.add_peer(peer.meta)
        theirs = np.frombuffer(seeded(size, 5), np.uint8)
        mine = t.allocate(size + PAGE)
        ops = [TransferOp(mine, i * PAGE, peer.desc, i * PAGE, PAGE) for i in range(size // PAGE)]

        # a frozen peer: the transfer's own deadline fires, the wait is bounded
        t.timeout = 1.0
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            await wait_until(lambda: _stopped(peer.proc.pid))  # stopped before the read posts
            h = t.read(ops[:16])
            with pytest.raises(TransferTimeoutError):
                await h.wait(timeout=10.0)  # the transfer's own 1 s deadline fires first
        finally:
            peer.proc.send_signal(signal.SIGCONT)
        t.timeout = 10.0
        await t.read(ops[:1])  # the peer is back
        assert pages(mine.view, 0) == theirs[:PAGE].tobytes()

        # a peer killed mid-transfer: PeerError (not a timeout), pages consistent
        before = np.frombuffer(os.urandom(size + PAGE), np.uint8)
        np.frombuffer(mine.view, np.uint8)[:] = before
        error: BaseException | None = None
        for attempt in range(5):  # the first read is normally cut short; later ones must fail
            handle = t.read(ops)
            if attempt == 0:
                await asyncio.sleep(0.005)
                peer.proc.kill()
            try:
                await handle
            except PeerError as exc:
                error = exc
                break
        assert isinstance(error, PeerError)
        now = np.frombuffer(mine.view, np.uint8)
        # every byte is what was there or the peer's byte for that place; past the batch: untouched
        assert np.all((now[:size] == before[:size]) | (now[:size] == theirs))
        assert np.array_equal(now[size:], before[size:])
        del now


async def test_missing_nixl_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    with pytest.raises(TransportError, match="pip install --no-deps nixl-cu12"):
        create("nixl")
