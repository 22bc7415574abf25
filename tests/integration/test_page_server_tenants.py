"""A page server with tenants, over tcp and shm: two tenants (and the default secret) on one
server each read their own pages and get misses for the others' identical keys, another
tenant's page answers exactly as a page nobody holds, a secret claiming another tenant is
refused (as an unknown tenant is, alike), and over tcp a tenant's transport reads and writes
only the slots of its own leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierkv import KVStore
from tierkv.errors import InvalidInputError, TenantError
from tierkv.remote import (
    PageServer,
    RemoteError,
    RemoteRefusedError,
    RemoteTier,
    TenantRefusedError,
)
from tierkv.remote.protocol.control import Control
from tierkv.remote.protocol.tenancy import TenantKeys
from tierkv.remote.sources.client import ReadLease
from tierkv.spec import KVSpec
from tierkv.transports.session import StreamSession

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
DEFAULT = b"tenants-test-default"
SECRETS = {"acme": b"acme-secret-0001", "beta": b"beta-secret-0002"}
TIMEOUT = 3.0
N = 4
KEYS = [bytes([i]) * 18 for i in range(1, N + 1)]  # the same prompt's pages, for everyone
KINDS = ["tcp", "shm"]


def pages(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, (N, PAGE), np.uint8)


@contextlib.asynccontextmanager
async def page_server(kind: str, **kw: Any) -> AsyncIterator[PageServer]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=32 * PAGE, codec=None)
    kw.setdefault("secrets", SECRETS)
    async with (
        store,
        PageServer(store, transports=[kind], secret=DEFAULT, timeout=TIMEOUT, **kw) as srv,
    ):
        yield srv


def client(srv: PageServer, tenant: str | None, secret: bytes | None = None) -> RemoteTier:
    if secret is None:
        secret = DEFAULT if tenant is None else SECRETS[tenant]
    kind = next(iter(srv.transports))
    return RemoteTier(
        srv.address, transport=kind, secret=secret, spec=SPEC, timeout=TIMEOUT, tenant=tenant
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_each_tenant_reads_its_own_pages_and_misses_the_others(kind: str) -> None:
    own = {"acme": pages(1), "beta": pages(2), None: pages(3)}
    out = np.zeros((N, PAGE), np.uint8)
    slots = list(range(N))
    async with (
        page_server(kind) as srv,
        client(srv, "acme") as acme,
        client(srv, "beta") as beta,
        client(srv, None) as plain,
    ):
        assert await acme.publish(KEYS, own["acme"], slots) == N
        for other in (beta, plain):  # the same keys, another tenant (or none): misses
            assert await other.lookup(KEYS) == 0
            assert await other.load(KEYS, out, slots) == 0
            assert await other.locate(KEYS) == []
        # the same keys, stored anew for each (never "already held": that would tell)
        assert await beta.publish(KEYS, own["beta"], slots) == N
        assert await plain.publish(KEYS, own[None], slots) == N
        for peer in (acme, beta, plain):
            out[:] = 0
            assert await peer.lookup(KEYS) == N
            assert await peer.load(KEYS, out, slots) == N
            assert (out == own[peer.tenant]).all()
            assert peer.corrupt == 0
        st = srv.stats()
        assert st["pages"] == 3 * N
        for name in SECRETS:
            t = st["tenants"][name]
            assert t["pages"] == N and t["bytes"] == N * PAGE
            assert t["published_pages_total"] == N and t["served_pages_total"] == N
            assert t["sessions_total"] == 1 and t["auth_refused_total"] == 0
        async with client(srv, None) as operator:  # the default's reply stays within bounds
            told = await operator.stats()
            assert "tenants" not in told and told["unknown_tenant_refused_total"] == 0
            assert len(told) <= 48  # REPLY_LIMITS: maps of at most 64
        # a tenant's session is told its own figures only
        told = await acme.stats()
        assert told["tenant"] == "acme" and told["pages"] == N and "tenants" not in told
        assert "host_used" not in told


@pytest.mark.parametrize("kind", KINDS)
async def test_another_tenants_page_answers_as_a_page_nobody_holds(kind: str) -> None:
    never = [bytes([0x40 + i]) * 18 for i in range(N)]
    async with (
        page_server(kind) as srv,
        client(srv, "acme") as acme,
        client(srv, "beta") as beta,
    ):
        await acme.publish(KEYS, pages(1), list(range(N)))
        ctl = Control(srv.address, secret=SECRETS["beta"], timeout=TIMEOUT, tenant="beta")
        await ctl.open()
        try:
            for op in ("lookup", "acquire", "locate", "watch", "reserve"):
                seen = await ctl.call(op, keys=KEYS)
                unseen = await ctl.call(op, keys=never)
                for r in (seen, unseen):
                    r.pop("id")
                    r.pop("lease", None)
                    if op == "reserve":  # both reserved anew: nothing was "already held"
                        assert len(r["slots"]) == N and -1 not in r.pop("slots")
                assert seen == unseen, op
        finally:
            await ctl.aclose()
        assert await beta.lookup(KEYS) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_secret_claiming_another_tenant_is_refused_like_an_unknown_tenant(
    kind: str,
) -> None:
    async with page_server(kind) as srv:
        hostile = [
            ("beta", SECRETS["acme"]),  # acme's secret, claiming beta
            ("acme", DEFAULT),  # the default secret, claiming acme
            ("gamma", SECRETS["acme"]),  # a tenant nobody configured
            ("gamma", b"guess"),
        ]
        for tenant, secret in hostile:
            with pytest.raises(TenantRefusedError, match="no such tenant, or not its secret"):
                await client(srv, tenant, secret).connect()
        with pytest.raises(RemoteRefusedError) as err:  # a tenant's secret, no tenant named
            await client(srv, None, SECRETS["acme"]).connect()
        assert not isinstance(err.value, TenantRefusedError)
        st = srv.stats()
        assert st["auth_refused_total"] == len(hostile) + 1
        assert st["unknown_tenant_refused_total"] == 2  # gamma, twice
        assert st["tenants"]["beta"]["auth_refused_total"] == 1
        assert st["tenants"]["acme"]["auth_refused_total"] == 1
        assert st["leases"] == 0
        # the refusal of an unknown tenant and of a wrong secret are the same frame
        assert await _refusal(srv, "gamma", b"x") == await _refusal(srv, "beta", b"x")
        async with client(srv, "beta") as beta:  # the tenant itself still gets in
            assert await beta.lookup(KEYS) == 0


async def _refusal(srv: PageServer, tenant: Any, secret: bytes) -> Any:
    """What the server answers a client that names ``tenant`` and proves ``secret``."""
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    session = StreamSession(reader, writer, _limits())
    try:
        with pytest.raises(Exception) as err:
            await session.client_handshake(secret, "client", "probe", extra={"tenant": tenant})
        return type(err.value), str(err.value)
    finally:
        writer.close()


def _limits() -> Any:
    from tierkv.remote.protocol.wire import REPLY_LIMITS

    return REPLY_LIMITS


async def test_a_hostile_tenant_field_is_refused_like_a_bad_proof() -> None:
    async with page_server("tcp") as srv:
        for tenant in (7, b"acme", ["acme"], "x" * 200):
            assert await _refusal(srv, tenant, SECRETS["acme"]) == await _refusal(srv, "q", b"x")
        # past the hello's bounds: dropped without an answer
        assert (await _refusal(srv, "x" * 300, SECRETS["acme"]))[0] is ConnectionResetError
        st = srv.stats()
        assert st["leases"] == 0
        assert sum(t["auth_refused_total"] for t in st["tenants"].values()) == 0


async def test_over_tcp_a_tenant_reads_and_writes_only_the_slots_of_its_leases() -> None:
    out = np.zeros((N, PAGE), np.uint8)
    async with (
        page_server("tcp") as srv,
        client(srv, "acme") as acme,
        client(srv, "beta") as beta,
        client(srv, None) as plain,
    ):
        await beta.publish(KEYS, pages(2), list(range(N)))
        table = srv.store.tiers.table
        theirs = [table.slot(k, "host") for k in TenantKeys("beta", SECRETS["beta"]).keys(KEYS)]
        forged = ReadLease(0, KEYS, theirs, [0] * N)
        for spy in (acme, plain):  # beta's slots, read straight through the transport
            with pytest.raises(RemoteError, match="not ours to read"):
                await spy.read(forged, out, list(range(N)))
        assert not out.any()
        # its own pages, under a lease: read; the same slots once the lease ended: refused
        lease = await beta.acquire(KEYS)
        await beta.read(lease, out, list(range(N)))
        assert (out == pages(2)).all()
        assert await beta.release(lease) == N
        with pytest.raises(RemoteError, match="not ours to read"):
            await beta.read(lease, out, list(range(N)))
        # a write into slots beta reserved, from acme's transport: refused
        keys2 = [bytes([0x30 + i]) * 18 for i in range(N)]
        ctl = Control(srv.address, secret=SECRETS["beta"], timeout=TIMEOUT, tenant="beta")
        await ctl.open()
        try:
            reserved = (await ctl.call("reserve", keys=keys2))["slots"]  # live while we try
            assert min(reserved) >= 0
            for spy in (acme, plain):
                with pytest.raises(RemoteError, match="not ours to write"):
                    await spy._transfer("write", pages(9), list(range(N)), reserved)
        finally:
            await ctl.aclose()
        assert await beta.load(KEYS, out, list(range(N))) == N and (out == pages(2)).all()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tenants_watch_announces_its_own_keys(kind: str) -> None:
    async with page_server(kind) as srv, client(srv, "acme") as acme:
        await acme.publish(KEYS, pages(1), list(range(N)))
        gone: list[bytes] = []
        arrived = asyncio.Event()

        def heard(keys: list[bytes]) -> None:
            gone.extend(keys)
            if len(gone) == N:
                arrived.set()

        w = await acme.watch(KEYS, callback=heard)
        try:
            stored = TenantKeys("acme", SECRETS["acme"]).keys(KEYS)
            srv.store.tiers.cold.forget_in("host", stored)
            await asyncio.wait_for(arrived.wait(), TIMEOUT)
        finally:
            await w.aclose()
        assert sorted(gone) == sorted(KEYS)
        assert srv.stats()["tenants"]["acme"]["pages"] == 0


@pytest.mark.parametrize(
    ("secrets", "error"),
    [
        ({"acme": b"same", "beta": b"same"}, InvalidInputError),  # a proof would not say who
        ({"acme": DEFAULT}, InvalidInputError),  # the default's secret
        ({"acme": b""}, InvalidInputError),
        ({"a:b": b"s"}, TenantError),
        ({"acme": "text"}, TenantError),
        (["acme"], TenantError),
    ],
)
def test_bad_tenant_secrets_are_typed_errors_at_construction(secrets: Any, error: type) -> None:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=8 * PAGE, codec=None)
    with pytest.raises(error):
        PageServer(store, secret=DEFAULT, secrets=secrets)


def test_tenants_need_transports_that_prove_a_secret() -> None:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=8 * PAGE, codec=None)
    with pytest.raises(InvalidInputError, match="prove a secret"):
        PageServer(store, secret=DEFAULT, secrets=SECRETS, transports=["loopback"])


def test_a_bad_tenant_name_at_the_client_is_a_typed_error() -> None:
    with pytest.raises(TenantError):
        RemoteTier("127.0.0.1:1", secret=b"s", tenant="no spaces")


def test_tenant_keys_keep_length_and_kind_and_differ_per_tenant_and_secret() -> None:
    content, private = bytes(18), b"\x80" + bytes(15)
    a, b = TenantKeys("acme", b"s1"), TenantKeys("beta", b"s1")
    a2 = TenantKeys("acme", b"s2")
    for k in (content, private):
        assert len(a.key(k)) == len(k)
        assert (a.key(k)[0] & 0x80) == (k[0] & 0x80)
        assert len({k, a.key(k), b.key(k), a2.key(k)}) == 4
        assert a.key(k) == TenantKeys("acme", b"s1").key(k)  # stable (not Python's hash)
    assert a.key(content).hex() == TenantKeys("acme", b"s1").keys([content])[0].hex()
    # the formula of docs/security.md, computed here on its own: stable across processes
    kdk = hmac.new(b"s1", b"tierkv-tenant-keys/v1acme", hashlib.sha256).digest()
    for k in (content, private, bytes(range(16)), b"\x7f" * 64):
        want = bytearray(hashlib.blake2b(k, digest_size=len(k), key=kdk).digest())
        want[0] = (want[0] & 0x7F) | (k[0] & 0x80)
        assert a.key(k) == bytes(want)
    assert a.key(b"") == b"" and a.key(bytes(65)) == bytes(65)  # no page server takes these


async def test_a_tenants_cluster_finds_its_pages_in_the_directory_and_no_other_does() -> None:
    pytest.importorskip("redis")
    sys.path.insert(0, str(Path(__file__).parent))
    from redis_server import RedisServer, skip_without_redis

    from tierkv.remote import RemoteCluster

    skip_without_redis()
    out = np.zeros((N, PAGE), np.uint8)

    def cluster(url: str, tenant: str | None) -> RemoteCluster:
        secret = DEFAULT if tenant is None else SECRETS[tenant]
        return RemoteCluster(directory=url, secret=secret, spec=SPEC, tenant=tenant)

    with RedisServer() as redis_server:
        url = redis_server.url
        async with (
            page_server("tcp", directory=url, directory_ttl=2.0) as srv,
            cluster(url, "acme") as acme,
            cluster(url, "beta") as beta,
            cluster(url, None) as plain,
        ):
            async with client(srv, "acme") as writer:
                assert await writer.publish(KEYS, pages(1), list(range(N))) == N
            deadline = time.monotonic() + 20
            while await acme.lookup(KEYS) < N:  # the directory hears within the agent's linger
                assert time.monotonic() < deadline, "acme's pages never reached the directory"
                await asyncio.sleep(0.02)
            assert await acme.locate(KEYS) == [srv.address] * N
            assert await acme.load(KEYS, out, list(range(N))) == N and (out == pages(1)).all()
            for other in (beta, plain):  # the same keys: not in the directory for them
                assert await other.locate(KEYS) == []
                assert await other.load(KEYS, out, list(range(N))) == 0


async def test_per_tenant_figures_reach_prometheus() -> None:
    pytest.importorskip("prometheus_client")
    from tierkv.metrics import PageServerCollector

    async with page_server("tcp") as srv:
        async with client(srv, "acme") as acme:
            assert await acme.publish(KEYS, pages(1), list(range(N))) == N
        with pytest.raises(TenantRefusedError):
            await client(srv, "beta", SECRETS["acme"]).connect()
        samples = {
            (s.name, s.labels.get("tenant")): s.value
            for fam in PageServerCollector(srv).collect()
            for s in fam.samples
        }
    assert samples["tierkv_page_server_tenant_pages", "acme"] == N
    assert samples["tierkv_page_server_tenant_bytes", "acme"] == N * PAGE
    assert samples["tierkv_page_server_tenant_published_pages_total", "acme"] == N
    assert samples["tierkv_page_server_tenant_sessions_total", "acme"] == 1
    assert samples["tierkv_page_server_tenant_auth_refused_total", "beta"] == 1
    assert samples["tierkv_page_server_tenant_pages", "beta"] == 0


def test_the_servers_tenant_keys_are_the_clients_and_their_cache_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierkv.remote.server import tenants

    monkeypatch.setattr(tenants, "CACHED_KEYS", 8)
    server = tenants.ServerTenants(SECRETS, DEFAULT)
    keys = [i.to_bytes(2, "big") * 9 for i in range(20)]
    want = TenantKeys("acme", SECRETS["acme"]).keys(keys)
    assert server.keys("acme", keys) == want  # derived now
    assert server.cached("acme") == 8 and server.cached("beta") == 0
    assert server.keys("acme", keys[-8:]) == want[-8:]  # remembered
    assert server.keys("acme", keys[:3]) == want[:3]  # forgotten, derived again
    assert server.cached("acme") == 8
    assert server.keys(None, keys) is keys  # the default's keys are its own
