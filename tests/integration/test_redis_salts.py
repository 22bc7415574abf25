"""Cache salts through a shared Redis tier (issue 29): pages a store pushed to Redis under one
salt are imported by another store for a prompt of the same salt only; another salt (or none)
imports nothing, because its keys differ."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("redis")
pytest.importorskip("xxhash")

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, skip_without_redis

from tierkv import KVStore
from tierkv.remote import RedisTier
from tierkv.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PB = SPEC.page_bytes


@pytest.fixture
def server() -> Iterator[RedisServer]:
    skip_without_redis()
    with RedisServer() as srv:
        yield srv


def tokens(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(16 * 3 + 1)]  # three full blocks and one token


async def fill(s: KVStore, sid: str, seed: int, salt: str | None) -> None:
    await s.add_sequence(sid, tokens(seed), salt=salt)
    g = torch.Generator().manual_seed(seed)
    async with s.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            k = torch.randn(SPEC.num_kv_heads, len(tokens(seed)), SPEC.head_dim, generator=g).half()
            await lease.append(sid, layer, k, k + 1)
    await s.release(sid)


async def test_a_salted_prefix_in_redis_is_imported_for_its_salt_only(server: RedisServer) -> None:
    def store(rt: RedisTier) -> KVStore:
        return KVStore(SPEC, device_bytes=8 * PB, host_bytes=8 * PB, codec=None, remote=rt)

    async with (
        RedisTier(server.url, spec=SPEC, namespace="m", timeout=2.0) as rt,
        store(rt) as a,
        store(rt) as b,
    ):
        await fill(a, "alice", 1, "alice")
        for i in range(2, 8):  # other prompts push alice's pages out of a's host, into Redis
            await fill(a, f"o{i}", i, None)
        await a.drain()
        assert a.stats()["remote"]["pushes"] > 0
        for other in ("mallory", None):
            assert await b.add_sequence(f"p-{other}", tokens(1), salt=other) == 0
            await b.release(f"p-{other}")
        assert b.stats()["remote"]["hits"] == 0
        assert await b.add_sequence("alice-again", tokens(1), salt="alice") == 48
        assert b.stats()["remote"]["hits"] == 3 * SPEC.num_layers


async def test_prefix_helpers_key_by_salt_and_charge_the_importing_tenant(
    server: RedisServer,
) -> None:
    """publish_prefix / import_prefix / prefix_pages take the salt the prompt was stored
    under (they hashed without it: a salted prefix could not be moved explicitly), and
    import_prefix charges the imported pages to the tenant named."""
    from tierkv import Quota, TenantError, UnknownTenantError
    from tierkv.remote import import_prefix, prefix_pages, publish_prefix, stage_prefix

    toks = tokens(3)
    async with RedisTier(server.url, spec=SPEC, namespace="m", timeout=2.0) as rt:
        a = KVStore(SPEC, device_bytes=8 * PB, host_bytes=8 * PB, codec=None)
        b = KVStore(
            SPEC,
            device_bytes=8 * PB,
            host_bytes=8 * PB,
            codec=None,
            tenants={"acme": Quota(), "beta": Quota()},
        )
        async with a, b:
            await fill(a, "x", 3, "s1")
            assert await stage_prefix(a, toks, salt="s1") >= 0
            assert await publish_prefix(a, rt, toks) == 0  # unsalted keys: nothing cached
            assert await publish_prefix(a, rt, toks, salt="s2") == 0
            assert await publish_prefix(a, rt, toks, salt="s1") == 3 * SPEC.num_layers
            for bad in ("", 7):
                with pytest.raises(TenantError):
                    await import_prefix(b, rt, toks, salt=bad)  # type: ignore[arg-type]
            with pytest.raises(UnknownTenantError):
                await import_prefix(b, rt, toks, salt="s1", tenant="nobody")
            with pytest.raises(UnknownTenantError):
                await import_prefix(a, rt, toks, salt="s1", tenant="acme")  # a has no tenants
            assert b.lookup(toks) == 0  # the refused calls changed nothing
            assert await import_prefix(b, rt, toks, salt="s2", tenant="acme") == 0
            assert await import_prefix(b, rt, toks, salt="s1", tenant="acme") == 48
            assert b.tenants is not None
            pages = prefix_pages(b, toks, salt="s1")
            plain, other = prefix_pages(b, toks), prefix_pages(b, toks, salt=b"s2")
            assert len(pages) == len(plain) == 3 * SPEC.num_layers
            assert not (set(pages) & set(plain) or set(pages) & set(other))
            assert {b.tenants.charged(k) for k in pages} == {"acme"}
            assert await b.add_sequence("y", toks, salt="s1", tenant="beta") == 48
