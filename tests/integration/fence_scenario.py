"""The late one-sided write of issue 23, as one round against a live page server: writer A
reserves slots, its reservation ends (by ttl, by closing its control connection, or by a relay
that closes it), writer B publishes other pages, A writes 0xAA into its old slots and commits,
and B's pages are read back. Used by tests/integration/test_fence.py and benchmarks/fence.py.

A round's outcome (`Outcome`): wrong pages B read back (0 expected), and how A's late write
ended: refused by the transport, refused by A's own transport (its access was revoked), or
landed in slots the server keeps quarantined (no one reads them); and whether A's commit was
told (LeaseExpiredError).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from relay import relay  # tests/integration, on the path of whoever imports this module

import tierkv.transports as transports
from tierkv import KVSpec
from tierkv.remote import PageServer, RemoteTier
from tierkv.remote.errors import LeaseExpiredError, PeerGoneError
from tierkv.remote.protocol.control import Control
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"fence-test"
TIMEOUT = 5.0
N = 4  # pages per writer
VARIANTS = ("ttl", "close", "relay")
#: writer A: names its agent in reserve; names none; names it but never reads its links, so it
#: never hears a revocation (a process stalled between its reserve and its write)
WRITERS = ("declared", "undeclared", "deaf")


@dataclass
class Outcome:
    """What one round saw."""

    wrong: int = 0  # B's pages read back with other bytes than B wrote
    missing: int = 0  # B's pages not read back at all
    refused: int = 0  # A's late write refused by the page server's transport
    revoked: int = 0  # A's late write refused by A's own transport (access revoked)
    quarantined: int = 0  # A's late write landed, in slots the server keeps from everyone
    told: int = 0  # A's late commit raised LeaseExpiredError


def key(round_: int, writer: int, i: int) -> bytes:
    """A content key (high bit clear) unique to a round, a writer and a page."""
    return bytes([writer, i]) + round_.to_bytes(14, "big")


@contextlib.asynccontextmanager
async def page_server(kind: str, **kw: Any) -> AsyncIterator[PageServer]:
    """A page server over ``kind`` with 32 host pages."""
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=32 * PAGE, codec=None)
    async with (
        store,
        PageServer(store, transports=[kind], secret=SECRET, timeout=TIMEOUT, **kw) as srv,
    ):
        yield srv


def writer_b(srv: PageServer, kind: str) -> RemoteTier:
    """Writer B (and the reader of its pages): a RemoteTier over ``kind``."""
    return RemoteTier(srv.address, transport=kind, secret=SECRET, spec=SPEC, timeout=TIMEOUT)


async def until(cond: Any, what: str) -> None:
    """Wait (bounded) until ``cond()`` holds: the server's state moves on its own loop turns."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"never: {what}")


async def _deaf(agent: str, session: Any) -> None:
    """An shm link follower that never reads: its transport never hears a revocation."""
    await asyncio.Event().wait()


class WriterA:
    """The late writer: a control connection (direct or through a relay) and a data transport
    of its own."""

    def __init__(self, srv: PageServer, kind: str, *, writer: str = "declared") -> None:
        self.srv, self.kind, self.writer = srv, kind, writer
        self.ctl: Control | None = None
        self.t: transports.Transport | None = None
        self.desc: transports.RegionDescriptor | None = None
        self.buf = np.full((N, PAGE), 0xAA, dtype=np.uint8)

    async def open(self, address: str) -> None:
        self.ctl = Control(address, secret=SECRET, timeout=TIMEOUT)
        hello = await self.ctl.open()
        info = hello["transports"][self.kind]
        self.desc = transports.RegionDescriptor.unpack(info["region"])
        self.t = transports.create(self.kind, secret=SECRET, timeout=TIMEOUT)
        if self.writer == "deaf" and self.kind == "shm":
            self.t._watch = _deaf  # type: ignore[attr-defined]
        await self.t.start()
        await self.t.add_peer(info["metadata"])

    async def reserve(self, keys: list[bytes]) -> tuple[int, list[int]]:
        assert self.ctl is not None and self.t is not None
        fields: dict[str, Any] = {"keys": keys}
        if self.writer != "undeclared":
            fields["agent"] = self.t.name
        rep = await self.ctl.call("reserve", **fields)
        return rep["lease"], rep["slots"]

    async def late_write(self, slots: list[int], out: Outcome) -> None:
        """0xAA into ``slots`` of the server's host arena; counts how it ended."""
        assert self.t is not None and self.desc is not None
        region = self.t.register_memory(self.buf)
        try:
            ops = [
                transports.TransferOp(region, i * PAGE, self.desc, s * PAGE, PAGE)
                for i, s in enumerate(slots)
            ]
            handle = self.t.write(ops)
            try:
                await handle.wait(TIMEOUT)
            except transports.RemoteAccessError:
                out.refused += 1
                return
            except transports.PeerError:
                out.revoked += 1
                return
            out.quarantined += 1
        finally:
            self.t.deregister(region)

    async def commit(self, lease: int, out: Outcome) -> None:
        assert self.ctl is not None
        try:
            await self.ctl.call("commit", lease=lease, ok=True)
        except LeaseExpiredError:
            out.told += 1
        except PeerGoneError:
            pass  # its connection is gone: nobody to tell

    async def aclose(self) -> None:
        if self.ctl is not None:
            await self.ctl.aclose()
        if self.t is not None:
            await self.t.aclose()


async def again(call: Callable[[], Awaitable[int]]) -> int:
    """``call()``, once more after PeerGoneError: an undeclared writer's fence over shm revokes
    every peer's link, and a client reconnects on its next call."""
    try:
        return await call()
    except PeerGoneError:
        return await call()


async def one_round(
    srv: PageServer, b: RemoteTier, kind: str, variant: str, r: int, *, writer: str
) -> Outcome:
    """One round of the repro (``variant``: how A's reservation ends)."""
    out = Outcome()
    ka = [key(r, 1, i) for i in range(N)]
    kb = [key(r, 2, i) for i in range(N)]
    a = WriterA(srv, kind, writer=writer)
    d = srv.directory
    assert d is not None
    async with relay(srv) as (via, state):
        try:
            await a.open(via if variant == "relay" else srv.address)
            fenced = d.fenced  # before the reserve: a short ttl may end it before its answer
            lease, slots = await a.reserve(ka)
            if variant == "ttl":
                await until(lambda: d.fenced > fenced, "the reservation expired")
            elif variant == "close":
                assert a.ctl is not None
                await a.ctl.aclose()
            else:
                state["writer"].close()  # the relay cuts A's line to the server
            await until(lambda: d.fenced > fenced, "the reservation was fenced")
            pages = np.full((N, PAGE), 0xBB, dtype=np.uint8)
            await again(lambda: b.publish(kb, pages, list(range(N))))
            await a.late_write(slots, out)
            await a.commit(lease, out)
            back = np.zeros((N, PAGE), dtype=np.uint8)
            got = await again(lambda: b.load(kb, back, list(range(N))))
            out.missing = N - got
            out.wrong = sum(1 for i in range(got) if not (back[i] == 0xBB).all())
        finally:
            await a.aclose()
    return out


def server_store_ok(srv: PageServer) -> bool:
    """The page table's invariants hold and no slot is held by a write lease that ended."""
    srv.store.tiers.table.check()
    d = srv.directory
    return d is not None and d.leases == 0 and d.quarantined == 0
