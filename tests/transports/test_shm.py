"""The shm transport: in one process, and against a peer in another process."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import zlib
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.transports import (
    PeerError,
    ProtocolError,
    RegionDescriptor,
    RemoteAccessError,
    TransferOp,
)
from tierkv.transports.probe import Probe
from tierkv.transports.shm import ShmTransport, remove_stale_segments, segment_name

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


def _connect_as(uid: int, address: str) -> bytes:
    """Fork a child that becomes ``uid``, connects to ``address`` and returns what it read
    (b"" when the owner closed the connection)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no asyncio, no pytest, only blocking calls and _exit
        out = b"?"
        try:
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(address)
            out = s.recv(64) or b"closed"
        except Exception as exc:
            out = f"error {exc}".encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    try:
        os.waitpid(pid, 0)
        return os.read(r, 256)
    finally:
        os.close(r)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another uid")
async def test_another_uid_is_refused_unless_allowed() -> None:
    loop = asyncio.get_running_loop()
    async with ShmTransport("owner") as t:
        got = await loop.run_in_executor(None, _connect_as, 65534, t._address)
        assert got == b"closed"
        assert t.audit.counts["auth_refused"] == 1
    async with ShmTransport("owner", allow_uids=[65534]) as t:
        got = await loop.run_in_executor(None, _connect_as, 65534, t._address)
        assert b"challenge" in got  # admitted to the handshake


async def test_with_a_secret_both_ends_must_prove_it() -> None:
    async with (
        ShmTransport("a", secret=b"s1") as a,
        ShmTransport("b", secret=b"s1") as b,
        ShmTransport("c", secret=b"other") as c,
        ShmTransport("d") as d,
    ):
        theirs = b.allocate(PAGE)
        await a.add_peer(b.metadata())  # same secret: fine
        mine = a.allocate(PAGE)
        await a.write([TransferOp(mine, 0, theirs.descriptor, 0, PAGE)], notify=b"ok")
        assert (await b.get_notification(2)).data == b"ok"
        for stranger in (c, d):
            with pytest.raises(PeerError):
                await stranger.add_peer(b.metadata())
        assert b.audit.counts["auth_refused"] == 2


async def test_notifications_nobody_reads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ShmTransport, "max_notification_bytes", 1 << 20)
    async with ShmTransport("a") as a, ShmTransport("b") as b:
        theirs = b.allocate(PAGE)
        mine = a.allocate(PAGE)
        await a.add_peer(b.metadata())
        op = [TransferOp(mine, 0, theirs.descriptor, 0, 1)]
        with pytest.raises(PeerError):
            for _ in range(100):  # 100 x 60 KiB: past the 1 MiB budget the link is dropped
                await a.write(op, notify=b"n" * 60_000)
                await asyncio.sleep(0)
        assert b.notifications_dropped == 1
        assert b._notification_bytes <= 1 << 20
        assert b.audit.counts["budget_hit"] == 1


async def test_oversized_notifications_are_refused_at_the_sender() -> None:
    async with ShmTransport("a") as a, ShmTransport("b") as b:
        theirs, mine = b.allocate(PAGE), a.allocate(PAGE)
        await a.add_peer(b.metadata())
        with pytest.raises(ProtocolError):
            a.write([TransferOp(mine, 0, theirs.descriptor, 0, 1)], notify=bytes(1 << 17))


def test_stale_segments_of_gone_owners_are_removed() -> None:
    mine = SharedMemory(name=segment_name(), create=True, size=4096)
    pid = os.getpid()
    dead = SharedMemory(name=f"tkv-host-{pid}-1-abcdef", create=True, size=4096)  # reused pid
    gone = SharedMemory(name="tkv-4194000-77-abcdef", create=True, size=4096)  # no such pid
    other = SharedMemory(name="tkvx-4194000-77-abcdef", create=True, size=4096)  # not ours
    try:
        removed = remove_stale_segments()
        assert dead.name in removed and gone.name in removed
        assert _segment_exists(mine.name) and _segment_exists(other.name)
        assert not _segment_exists(dead.name) and not _segment_exists(gone.name)
    finally:
        for seg in (mine, dead, gone, other):
            seg.close()
            try:
                seg.unlink()
            except FileNotFoundError:  # removed above: tell the resource tracker too
                resource_tracker.unregister(f"/{seg.name}", "shared_memory")


class _Owner:
    """An shm transport (with a secret) serving from its own loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _, ctx: self.errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.t = self.call(ShmTransport("owner", secret=b"s", timeout=2).start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def probe(self, authenticate: bool) -> Probe:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(self.t._address)
        p = Probe(sock)
        if authenticate:
            assert p.handshake(b"s", role="shm-peer", ident="fuzzer")["op"] == "welcome"
        else:
            assert p.recv()["op"] == "challenge"  # type: ignore[index]
        return p

    def close(self) -> None:
        self.call(self.t.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def owner() -> Iterator[_Owner]:
    o = _Owner()
    yield o
    o.close()


msgs = st.fixed_dictionaries(
    {"op": st.sampled_from(["notify", "dereg", "auth", "zz"])},
    optional={
        "data": st.binary(max_size=300) | st.integers(0, 2**64 - 1),
        "region": st.integers(-(2**63), 2**63 - 1) | st.text(max_size=4),
    },
)
blobs = st.one_of(
    st.binary(max_size=200),
    st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "big")),
    st.integers(1, 3000)
    .map(lambda d: b"\x91" * d + b"\xc0")
    .map(lambda b: len(b).to_bytes(4, "big") + b),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(msgs, max_size=4), tail=blobs, authenticate=st.booleans())
def test_the_control_socket_survives_fuzzing(
    owner: _Owner, frames: list[dict[str, Any]], tail: bytes, authenticate: bool
) -> None:
    """Random, truncated, oversized and deeply nested frames before and after the handshake:
    the owner stays up and nothing fails untyped."""
    with owner.probe(authenticate) as p:
        try:
            p.sock.sendall(b"".join(p.frame(f) for f in frames) + tail)
            p.sock.shutdown(socket.SHUT_WR)
            while p.sock.recv(1 << 16):
                pass
        except OSError:
            pass
    assert not owner.errors, owner.errors[:2]


def test_the_owner_still_serves_after_fuzzing(owner: _Owner) -> None:
    with owner.probe(True):
        pass
    assert owner.t._notification_bytes <= owner.t.max_notification_bytes
