"""Fenced one-sided writes (issue 23): a writer whose reservation ended (ttl, its control
connection closed, a relay that closed it) can no longer corrupt another writer's pages, is
told so at its commit, and the slots it held come back once its write has ended for certain."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from tierkv.remote.errors import LeaseExpiredError, RemoteFullError

sys.path.insert(0, str(Path(__file__).parent))
from fence_scenario import (
    SPEC,
    VARIANTS,
    N,
    WriterA,
    key,
    one_round,
    page_server,
    server_store_ok,
    until,
    writer_b,
)


def _ttl(variant: str) -> float:
    return 0.05 if variant == "ttl" else 30.0


@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_late_write_never_reaches_another_writers_pages(kind: str, variant: str) -> None:
    """The repro: 0 wrong pages; the late write is refused (tcp: the server's guard; shm: A's
    own transport, whose access was revoked), and a commit A can still send is told."""
    async with page_server(kind, lease_ttl=_ttl(variant)) as srv, writer_b(srv, kind) as b:
        for r in range(3):
            out = await one_round(srv, b, kind, variant, r, writer="declared")
            assert (out.wrong, out.missing) == (0, 0)
            assert out.refused + out.revoked == 1 and out.quarantined == 0
            assert out.told == (1 if variant == "ttl" else 0)
            await until(lambda: server_store_ok(srv), "the quarantine came back")
        assert srv.stats()["fenced_total"] == 3


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_writer_deaf_to_the_revocation_writes_into_quarantine(variant: str) -> None:
    """Over shm a writer stalled between its reserve and its write never hears that its
    access was revoked: its late write lands, in slots still quarantined (nobody reads them,
    nobody else is given them); they come back at its commit (ttl) or when its transport
    closes (its connection was cut)."""
    async with page_server("shm", lease_ttl=_ttl(variant)) as srv, writer_b(srv, "shm") as b:
        out = await one_round(srv, b, "shm", variant, 0, writer="deaf")
        assert (out.wrong, out.missing, out.quarantined) == (0, 0, 1)
        assert out.told == (1 if variant == "ttl" else 0)
        await until(lambda: server_store_ok(srv), "the quarantine came back")


@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_an_undeclared_writer_is_fenced_too(kind: str) -> None:
    """A writer that names no agent (the issue's Control client): over tcp its late write is
    refused; over shm every link is revoked (its own transport refuses the write, or it
    landed before the revocation, in slots still quarantined), and its late commit tells it."""
    async with page_server(kind, lease_ttl=0.05) as srv, writer_b(srv, kind) as b:
        out = await one_round(srv, b, kind, "ttl", 0, writer="undeclared")
        assert (out.wrong, out.missing, out.told) == (0, 0, 1)
        if kind == "tcp":
            assert out.refused == 1
        else:
            assert out.revoked + out.quarantined == 1
        await until(lambda: server_store_ok(srv), "the quarantine came back")


async def test_quarantine_holds_until_the_write_ends_and_is_bounded() -> None:
    """A writer whose revocation is never acknowledged (over shm: a paused process) keeps its
    slots quarantined (not handed out, not readable) until its commit; the quarantine counts
    against max_writing (a reserve past it is 'full')."""
    async with page_server("shm", lease_ttl=0.05, max_writing=2 * N) as srv:
        d = srv.directory
        assert d is not None
        never = asyncio.get_running_loop().create_future()
        srv.transports["shm"].write_fence = lambda agent: never  # type: ignore[method-assign]
        a = WriterA(srv, "shm", writer="undeclared")
        await a.open(srv.address)
        try:
            lease, slots = await a.reserve([key(0, 1, i) for i in range(N)])
            await until(lambda: d.quarantined == N, "the lease was fenced")
            held = set(slots)
            c = WriterA(srv, "shm", writer="declared")
            await c.open(srv.address)
            try:
                lc, other = await c.reserve([key(0, 3, i) for i in range(N)])
                assert not held & set(other)  # never handed to another writer
                with pytest.raises(RemoteFullError, match="quarantined"):
                    await c.reserve([key(0, 4, 0)])
                assert c.ctl is not None
                assert (await c.ctl.call("commit", lease=lc, ok=False))["stored"] == 0
            finally:
                await c.aclose()
            with pytest.raises(LeaseExpiredError):
                assert a.ctl is not None
                await a.ctl.call("commit", lease=lease, ok=True)
            assert d.quarantined == 0 and d.late_commits == 1
            srv.store.tiers.table.check()
        finally:
            await a.aclose()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_publish_of_an_expired_reservation_raises_a_typed_error(kind: str) -> None:
    """RemoteTier.publish whose reservation expires before its commit raises
    LeaseExpiredError, never returns 0 silently; the same RemoteTier publishes again after
    (over shm its revoked data link is replaced by a reconnect)."""
    async with page_server(kind, lease_ttl=30.0) as srv, writer_b(srv, kind) as b:
        d = srv.directory
        assert d is not None
        real = d.reserve

        def reserve_then_expire(keys, owner, sums=None, agent=None, tenant=None):  # type: ignore[no-untyped-def]
            lease, slots = real(keys, owner, sums, agent, tenant)
            d.expire(lease)  # the ttl runs out right after the answer
            return lease, slots

        d.reserve = reserve_then_expire  # type: ignore[method-assign]
        pages = np.full((N, SPEC.page_bytes), 7, dtype=np.uint8)
        with pytest.raises(LeaseExpiredError):
            await b.publish([key(0, 5, i) for i in range(N)], pages, list(range(N)))
        d.reserve = real  # type: ignore[method-assign]
        assert await b.publish([key(0, 5, i) for i in range(N)], pages, list(range(N))) == N
        back = np.zeros_like(pages)
        assert await b.load([key(0, 5, i) for i in range(N)], back, list(range(N))) == N
        assert (back == 7).all()
        await until(lambda: server_store_ok(srv), "the quarantine came back")


async def test_a_lease_is_released_only_by_its_own_connection() -> None:
    """Regression (found with the fence): ``release`` ended any read lease whatever connection
    named it (another client's reader then saw a miss), and popped a *write* lease it named
    without ending it, so the write's slots were never committed, fenced nor freed."""
    from fence_scenario import SECRET, TIMEOUT

    from tierkv.remote.protocol.control import Control

    async with page_server("tcp") as srv, writer_b(srv, "tcp") as b:
        keys = [key(9, 1, i) for i in range(N)]
        pages = np.full((N, SPEC.page_bytes), 5, dtype=np.uint8)
        assert await b.publish(keys, pages, list(range(N))) == N
        reader = Control(srv.address, secret=SECRET, timeout=TIMEOUT)
        other = Control(srv.address, secret=SECRET, timeout=TIMEOUT)
        await reader.open()
        await other.open()
        try:
            lease = (await reader.call("acquire", keys=keys))["lease"]
            assert (await other.call("release", lease=lease))["valid"] == 0  # not its lease
            assert (await reader.call("release", lease=lease))["valid"] == N  # still alive
            mine = [key(9, 2, i) for i in range(N)]
            w = (await reader.call("reserve", keys=mine))["lease"]
            for c in (other, reader):  # release never ends a write lease, whoever asks
                assert (await c.call("release", lease=w))["valid"] == 0
            assert (await reader.call("commit", lease=w, ok=False))["stored"] == 0
        finally:
            await reader.aclose()
            await other.aclose()
        await until(lambda: server_store_ok(srv), "every slot came back")
