"""RedisTier with tenants, against a private redis-server: every key a tenant's tier touches
carries the tenant (no tenant: the keys of old, byte for byte), two tenants never read each
other's pages, and a Redis ACL on the tenant's prefix confines a tenant's Redis user.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

redis = pytest.importorskip("redis")
pytest.importorskip("xxhash")  # with redis: the `redis` extra

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, skip_without_redis  # noqa: E402

from tierkv.errors import InvalidTypeError, TenantError  # noqa: E402
from tierkv.remote import RedisTier  # noqa: E402
from tierkv.remote.sources.redis_value import FORMAT, spec_digest  # noqa: E402
from tierkv.spec import KVSpec  # noqa: E402

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PB = SPEC.page_bytes
N = 5


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    skip_without_redis()
    with RedisServer() as running:
        yield running.url


@pytest.fixture
def srv(redis_url: str) -> Iterator[str]:
    """The module's server's URL, the server emptied, with no user but the default one."""
    with redis.Redis.from_url(redis_url) as r:
        r.flushall()
        for user in r.acl_users():
            if user != "default":
                r.acl_deluser(user)
    yield redis_url


def tier(url: str, tenant: str | None = None, **options: Any) -> RedisTier:
    """A tier of ``tenant`` whose failed calls leave the next one free to try (no backoff)."""
    t = RedisTier(url, spec=SPEC, namespace="test-model", timeout=2.0, tenant=tenant, **options)
    t.backoff_base = t.backoff_cap = 0.0
    return t


def keys_of(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(18) for _ in range(N)]


def pages_of(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed + 10_000).integers(0, 256, (N, PB), np.uint8)


#: the ACL docs/security.md gives a tenant's Redis user (after ``~tkv:*:t:<tenant>:*``): no
#: command that lists or counts keys regardless of its key pattern, none of the admin's
ACL = ("+@all", "-@dangerous", "-scan", "-randomkey", "-dbsize")


def acl_user(url: str, name: str, password: str) -> None:
    """A Redis user confined to the keys of tenant ``name`` (docs/security.md, *Tenants*)."""
    with redis.Redis.from_url(url) as r:
        r.execute_command(
            "ACL", "SETUSER", name, "reset", "on", f">{password}", f"~tkv:*:t:{name}:*", *ACL
        )


def test_keys_without_a_tenant_are_those_of_old_and_a_tenant_adds_its_part() -> None:
    key = bytes(range(18))
    old = f"tkv:test-model:{FORMAT}.{spec_digest(SPEC)[:4].hex()}:".encode()  # before tenants
    plain, acme = tier("redis://127.0.0.1:1/0"), tier("redis://127.0.0.1:1/0", "acme")
    assert plain.tenant is None and acme.tenant == "acme"
    assert plain.redis_key(key) == old + key.hex().encode()
    assert acme.redis_key(key) == old + b"t:acme:" + key.hex().encode()


@pytest.mark.parametrize("bad", ["", "a:b", "x" * 65, "-lead", "sp ace", b"acme", 7])
def test_a_bad_tenant_is_a_typed_error(bad: Any) -> None:
    with pytest.raises(TenantError) as err:
        tier("redis://127.0.0.1:1/0", tenant=bad)
    if not isinstance(bad, str):
        assert isinstance(err.value, InvalidTypeError)


async def test_tenants_never_read_each_others_pages(srv: str) -> None:
    keys = keys_of(1)  # the same page keys for everyone: same prompt, same model
    own = {name: pages_of(i) for i, name in enumerate(("acme", "beta", None))}
    out = np.zeros((N, PB), np.uint8)
    async with (
        tier(srv, tenant="acme") as acme,
        tier(srv, tenant="beta") as beta,
        tier(srv) as plain,
    ):
        assert await acme.publish(keys, own["acme"], list(range(N))) == N
        for other in (beta, plain):  # the same keys under another tenant (or none): misses
            assert await other.lookup(keys) == 0
            assert await other.load(keys, out, list(range(N))) == 0
        assert await beta.publish(keys, own["beta"], list(range(N))) == N  # its own copies
        assert await plain.publish(keys, own[None], list(range(N))) == N
        for t in (acme, beta, plain):
            assert await t.load(keys, out, list(range(N))) == N
            assert (out == own[t.tenant]).all()
            assert t.stats()["corrupt"] == t.stats()["errors"] == 0
    with redis.Redis.from_url(srv) as r:
        assert len(r.keys("*")) == 3 * N
        assert len(r.keys("tkv:*:t:acme:*")) == len(r.keys("tkv:*:t:beta:*")) == N


async def test_an_acl_on_the_tenant_prefix_confines_its_redis_user(srv: str) -> None:
    acl_user(srv, "acme", "pw-acme")
    acl_user(srv, "beta", "pw-beta")
    keys, out = keys_of(2), np.zeros((N, PB), np.uint8)
    async with (
        tier(srv, tenant="acme", username="acme", password="pw-acme") as acme,
        tier(srv, tenant="beta", username="beta", password="pw-beta") as beta,
        tier(srv) as plain,  # the default user: an operator's, no tenant
    ):
        assert await acme.publish(keys, pages_of(2), list(range(N))) == N  # allowed: its keys
        assert await acme.load(keys, out, list(range(N))) == N and (out == pages_of(2)).all()
        assert await beta.publish(keys, pages_of(3), list(range(N))) == N
        assert await plain.publish(keys, pages_of(4), list(range(N))) == N
        assert acme.stats()["errors"] == beta.stats()["errors"] == 0
        # acme's user, with acme's password, asking for beta's pages: Redis refuses every key
        async with tier(srv, tenant="beta", username="acme", password="pw-acme") as spy:
            assert await spy.lookup(keys) == 0
            assert await spy.load(keys, out, list(range(N))) == 0
            assert await spy.publish(keys, pages_of(5), list(range(N))) == 0
            assert spy.stats()["errors"] >= 3  # refused, counted, never raised
        async with tier(srv, username="acme", password="pw-acme") as spy:  # no tenant
            assert await spy.lookup(keys) == 0
    with redis.Redis.from_url(srv, username="acme", password="pw-acme") as r:
        for victim in (beta.redis_key(keys[0]), plain.redis_key(keys[0])):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.get(victim)
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.exists(victim)  # not even whether it exists
        assert r.get(acme.redis_key(keys[0])) is not None
        for listing in (r.keys, r.scan, r.randomkey, r.dbsize):  # names or counts of others'
            with pytest.raises(redis.exceptions.NoPermissionError):
                listing()
    with redis.Redis.from_url(srv) as r:  # nothing of beta's was overwritten by the spy
        async with tier(srv, tenant="beta") as beta_again:
            assert await beta_again.load(keys, out, list(range(N))) == N
            assert (out == pages_of(3)).all()
        assert len(r.keys("*")) == 3 * N


async def test_a_password_protected_server_serves_a_tenants_tier() -> None:
    # (the test helper starts redis-server with --requirepass; its url carries the password)
    skip_without_redis()
    keys, out = keys_of(4), np.zeros((N, PB), np.uint8)
    with RedisServer(password="pw: a/b@c") as running:
        assert running.url.startswith("redis://:pw%3A%20a%2Fb%40c@")
        async with tier(running.url, tenant="acme") as acme:
            assert await acme.publish(keys, pages_of(4), list(range(N))) == N
            assert await acme.load(keys, out, list(range(N))) == N
            assert (out == pages_of(4)).all()
        bare = running.url.replace(":pw%3A%20a%2Fb%40c@", "")
        async with tier(bare, tenant="acme") as nopass:  # no password: refused, counted
            assert await nopass.lookup(keys) == 0
            assert nopass.stats()["errors"] >= 1
        with redis.Redis.from_url(running.url) as r:
            assert len(r.keys("tkv:*:t:acme:*")) == N
