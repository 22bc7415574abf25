"""A page server over a store with tenants (issue 29): the pages a tenant's session publishes
are charged to that tenant and its quotas decide their room, as for its own requests: a peer
flooding past its tenant's limit evicts its own pages first and never a page of a tenant at
its reservation; with no room but those, its reserve is refused ("full"). A secret for a
tenant the store lacks is refused at construction."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from tierkv import KVStore, Quota, UnknownTenantError
from tierkv.remote import PageServer, RemoteFullError

sys.path.insert(0, str(Path(__file__).parent))
from test_page_server_tenants import DEFAULT, PAGE, SECRETS, SPEC, TIMEOUT, client

HOST = 32  # host pages of the server's store
BATCH = 4


def keys(first: int, n: int = BATCH) -> list[bytes]:
    """``n`` content page keys (the private bit clear), distinct per ``first``."""
    return [bytes([0x10, i % 256, i // 256]) + bytes(15) for i in range(first, first + n)]


def pages(seed: int, n: int = BATCH) -> np.ndarray:  # type: ignore[type-arg]
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), np.uint8)


@contextlib.asynccontextmanager
async def quota_server(**tenants: Quota) -> AsyncIterator[PageServer]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=HOST * PAGE, codec=None, tenants=tenants)
    async with (
        store,
        PageServer(
            store, transports=["tcp"], secret=DEFAULT, secrets=SECRETS, timeout=TIMEOUT
        ) as srv,
    ):
        yield srv


def host(srv: PageServer, name: str) -> dict[str, int]:
    return srv.store.stats()["tenants"][name]["tiers"]["host"]  # type: ignore[no-any-return]


async def test_a_flooding_peer_evicts_its_own_pages_never_a_reserved_tenants() -> None:
    # beta reserves 8 host pages and publishes 8; acme (a limit of 8) publishes 10x the host
    async with (
        quota_server(acme=Quota(host_limit=8 * PAGE), beta=Quota(host_reserve=8 * PAGE)) as srv,
        client(srv, "acme") as acme,
        client(srv, "beta") as beta,
    ):
        slots = list(range(BATCH))
        for i in range(2):
            assert await beta.publish(keys(1000 + i * BATCH), pages(i), slots) == BATCH
        assert host(srv, "beta")["pages"] == 8
        for i in range(10 * HOST // BATCH):
            assert await acme.publish(keys(i * BATCH), pages(100 + i), slots) == BATCH
        got = host(srv, "acme")
        assert got["pages"] > 8  # work-conserving: free room above its limit, then its own
        assert got["evicted"] >= 10 * HOST - HOST
        assert host(srv, "beta")["evicted"] == 0
        for i in range(2):  # beta's pages are all still there
            assert await beta.lookup(keys(1000 + i * BATCH)) == BATCH
        # beta needs room now: acme's pages over its limit go first, never beta's
        for i in range(2, 6):
            assert await beta.publish(keys(1000 + i * BATCH), pages(i), slots) == BATCH
        assert host(srv, "beta") == {**host(srv, "beta"), "pages": 24, "evicted": 0}
        assert host(srv, "acme")["pages"] <= 8
        st = srv.store.stats()["tenants"]
        assert st["acme"]["evictions_caused"] > 0 and st["beta"]["evictions_caused"] > 0
        srv.store.check()  # the counts equal the charged pages each tier holds


async def test_no_room_but_a_reserved_tenants_refuses_the_peer() -> None:
    async with (
        quota_server(acme=Quota(), beta=Quota(host_reserve=(HOST - 2) * PAGE)) as srv,
        client(srv, "acme") as acme,
        client(srv, "beta") as beta,
    ):
        slots = list(range(BATCH))
        for i in range((HOST - 2) // 2):
            two = keys(1000 + 2 * i, 2)
            assert await beta.publish(two, pages(i, 2), [0, 1]) == 2
        assert host(srv, "beta")["pages"] == HOST - 2
        with pytest.raises(RemoteFullError):  # 4 pages, 2 free: none of beta's may go
            await acme.publish(keys(0), pages(9), slots)
        assert host(srv, "beta")["evicted"] == 0
        assert host(srv, "acme")["pages"] == 0
        assert srv.store.stats()["tenants"]["acme"]["refusals"] == 1
        assert await acme.publish(keys(0, 2), pages(9, 2), [0, 1]) == 2  # what fits does
        srv.store.check()


async def test_a_secret_for_a_tenant_the_store_lacks_is_refused() -> None:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=HOST * PAGE, tenants={"acme": Quota()})
    with pytest.raises(UnknownTenantError):  # beta has a secret but no quota of the store
        PageServer(store, secret=DEFAULT, secrets=SECRETS)
