"""Tenants in the example server (issue 29): ``cache_salt`` as vLLM's OpenAI server takes it
(a request reuses cached prefixes of its own salt only), bad salts are 400s."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.serving import EngineConfig
from tierkv.tenants import Quota

sys.path.insert(0, str(Path(__file__).parent))
from test_server import MODEL, one_thread, post, served, server  # noqa: F401


async def test_cache_salt_separates_cached_prefixes(served: tuple[str, Any]) -> None:  # noqa: F811
    url, session = served
    rnd = random.Random(7)
    system = [rnd.randrange(MODEL.vocab) for _ in range(40)]
    req = {"max_tokens": 2, "temperature": 0}

    async def cached(tail: int, salt: str | None) -> int:
        body = {**req, "prompt": [*system, tail]}
        if salt is not None:
            body["cache_salt"] = salt
        status, got = await post(session, url, "/v1/completions", body)
        assert status == 200, got
        return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(1, "alice") == 0
    assert await cached(2, "alice") == 40  # her own prefix
    assert await cached(3, "bob") == 0  # the same prompt under another salt: no hit
    assert await cached(4, None) == 0  # nor without one
    assert await cached(5, "bob") == 40  # bob's own, computed above
    for bad in ("", "x" * 300, 5, ["alice"]):
        status, got = await post(
            session, url, "/v1/completions", {**req, "prompt": system, "cache_salt": bad}
        )
        assert status == 400 and got["error"]["param"] == "cache_salt", (bad, got)


PAGE = 1024  # the tiny model's page at 8 tokens (fp16 K/V, 2 KV heads of 8 dims, 2 layers)
# the device tier holds the owner's reservation and nothing more
OWNER_AND_OTHER = EngineConfig(
    max_running=2,
    page_tokens=8,
    max_context=40,
    device_bytes=10 * PAGE,
    tenants={"owner": Quota(device_reserve=10 * PAGE), "other": Quota()},
)


async def test_tenants_by_api_key_quotas_and_429() -> None:
    engine = OWNER_AND_OTHER
    cfg = server.ServerConfig(
        model="tiny",
        tiny=MODEL,
        engine=engine,
        max_tokens=8,
        api_keys={"k-owner": "owner", "k-other": "other"},
        admin_keys=frozenset({"k-admin"}),
    )
    runner, url = await server.start(cfg)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def ask(key: str | None, prompt: list[int]) -> tuple[int, Any]:
                head = {} if key is None else {"Authorization": f"Bearer {key}"}
                body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
                async with session.post(f"{url}/v1/completions", json=body, headers=head) as r:
                    return r.status, await r.json()

            assert (await ask(None, [1, 2, 3]))[0] == 401
            assert (await ask("k-nobody", [1, 2, 3]))[0] == 401
            status, got = await ask("k-owner", list(range(1, 39)))
            assert status == 200, got  # its 8 full-block pages stay cached on the device
            status, got = await ask("k-other", list(range(100, 120)))
            assert status == 429, got  # the device holds only the owner's reserved pages
            assert got["error"]["type"] == "invalid_request_error"
            admin = {"Authorization": "Bearer k-admin"}
            async with session.get(f"{url}/stats", headers=admin) as r:
                tenants = (await r.json())["store"]["tenants"]
            assert tenants["other"]["refusals"] >= 1
            assert tenants["owner"]["tiers"]["device"]["evicted"] == 0
            status, got = await ask("k-owner", list(range(1, 39)))  # the owner still hits
            assert status == 200 and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    finally:
        await runner.cleanup()


def test_bad_tenants_files_are_refused_with_the_reason(tmp_path: Any) -> None:
    import os

    def file(name: str, data: bytes | str) -> str:
        p = tmp_path / name
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        p.chmod(0o600)  # (API keys: readable by the owner only)
        return str(p)

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(server.MAX_TENANTS_FILE + 1)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o600)  # no writer: reading would wait for one forever
    cases = {
        file("broken.json", '{"tenants": {"a": {}'): "Expecting",
        file("list.json", "[1, 2]"): "want a JSON object",
        file("deep.json", "[" * 100_000 + "]" * 100_000): "recursion",
        file("twice.json", '{"tenants": {"a": {}, "a": {"host_limit": 1}}}'): "given twice",
        file("name.json", '{"tenants": {"a:b": {}}}'): "characters outside",
        file("case.json", '{"tenants": {"a": {}}, "api_keys": {"k": "A"}}'): "unknown tenants",
        file("nan.json", '{"tenants": {"a": {"host_limit": NaN}}}'): "must be an int",
        file("neg.json", '{"tenants": {"a": {"host_reserve": -1}}}'): "must be >= 0",
        file("field.json", '{"tenants": {"a": {"disk_limit": 1}}}'): "unexpected keyword",
        file("key.json", '{"tenants": {"a": {}}, "api_keys": {"": "a"}}'): "non-empty string",
        file("bin.json", b"\xff\xfe{}"): "utf-8",
        file("admin.json", '{"tenants": {"a": {}}, "admin_keys": ["x"]}'): "without api_keys",
        file(
            "admin2.json", '{"tenants": {"a": {}}, "api_keys": {"k": "a"}, "admin_keys": ["k"]}'
        ): "both",
        file(
            "admin3.json", '{"tenants": {"a": {}}, "api_keys": {"k": "a"}, "admin_keys": "x"}'
        ): "list of non-empty",
        str(huge): "over",
        str(fifo): "not a regular file",
        str(tmp_path / "missing.json"): "No such file",
    }
    for path, reason in cases.items():
        with pytest.raises(InvalidInputError) as got:
            server.tenant_options(path)
        assert reason in str(got.value), (path, got.value)
    good = file("good.json", '{"tenants": {"a": {"host_limit": 8}}, "api_keys": {"k": "a"}}')
    quotas, keys = server.tenant_options(good)
    assert quotas == {"a": Quota(host_limit=8)} and keys == {"k": "a"}


async def test_a_streamed_request_refused_before_its_first_token_gets_its_status() -> None:
    """A stream's headers went out before the first token: a request the tenant's quota
    refused was a 200 whose stream held an error event (no client or balancer retries on
    that). Now it is a 429 as without ``stream``; a stream that starts still streams."""
    engine = OWNER_AND_OTHER
    cfg = server.ServerConfig(model="tiny", tiny=MODEL, engine=engine, max_tokens=8)
    runner, url = await server.start(cfg)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def ask(tenant: str, prompt: list[int]) -> tuple[int, str, str]:
                body = {"prompt": prompt, "max_tokens": 2, "stream": True, "tenant": tenant}
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    return r.status, r.headers["Content-Type"], await r.text()

            status, kind, text = await ask("owner", list(range(1, 39)))
            assert status == 200 and kind.startswith("text/event-stream"), text
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            status, kind, text = await ask("other", list(range(100, 120)))
            assert status == 429 and kind.startswith("application/json"), (status, text)
            assert '"error"' in text
    finally:
        await runner.cleanup()


async def test_a_tenant_cannot_reach_another_tenants_pages_by_its_salt() -> None:
    """With API keys, a hostile tenant that sends the victim's cache_salt (or none, as the
    victim did) gets no prefix hit: the tenant is mixed into the salt. Fails on the old code
    (the salt alone keyed the pages: 32 cached tokens of the victim's prompt)."""
    cfg = server.ServerConfig(
        model="tiny",
        tiny=MODEL,
        engine=EngineConfig(
            max_running=2,
            page_tokens=8,
            max_context=64,
            tenants={"victim": Quota(), "probe": Quota()},
        ),
        max_tokens=8,
        api_keys={"k-victim": "victim", "k-probe": "probe"},
    )
    runner, url = await server.start(cfg)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def cached(key: str, tail: int, salt: str | None) -> int:
                body: dict[str, Any] = {
                    "prompt": [*range(1, 41), tail],
                    "max_tokens": 1,
                    "temperature": 0,
                }
                if salt is not None:
                    body["cache_salt"] = salt
                head = {"Authorization": f"Bearer {key}"}
                async with session.post(f"{url}/v1/completions", json=body, headers=head) as r:
                    got = await r.json()
                    assert r.status == 200, got
                return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

            for salt in ("secret", None):
                assert await cached("k-victim", 100, salt) == 0
                assert await cached("k-victim", 101, salt) == 40  # the victim's own prefix
                assert await cached("k-probe", 102, salt) == 0  # the same salt: no hit
                assert await cached("k-probe", 103, salt) == 40  # the probe's own, made above
    finally:
        await runner.cleanup()


def test_tenant_salt_is_stable_and_separates_tenants_and_salts() -> None:
    from tierkv.errors import TenantError
    from tierkv.tenant_names import tenant_salt

    a = tenant_salt("acme", b"s")
    assert a == tenant_salt("acme", b"s") and len(a) == 32
    others = {tenant_salt("acme", None), tenant_salt("acme", b"t"), tenant_salt("acme2", b"s")}
    others |= {tenant_salt("acm", b"es"), tenant_salt("acme", b"")}
    assert a not in others and len(others) == 5
    with pytest.raises(TenantError):
        tenant_salt("a:b", b"s")


def _a_and_b(keys: dict[str, str], admin: frozenset[str] = frozenset()) -> Any:
    """A tiny server's config with tenants a and b, and these API keys and admin keys."""
    return server.ServerConfig(
        model="tiny",
        tiny=MODEL,
        engine=EngineConfig(
            max_running=2, page_tokens=8, max_context=64, tenants={"a": Quota(), "b": Quota()}
        ),
        max_tokens=8,
        api_keys=keys,
        admin_keys=admin,
    )


async def test_a_tenant_reads_its_own_figures_only() -> None:
    """With API keys, /stats and /metrics told any client every tenant's figures (prompt
    tokens, hits, pages per tier: what another tenant's traffic hits and holds). Now a
    tenant's key reads its own tenant's figures in /stats, /metrics needs an admin key (403
    for a tenant's, 401 without a key), and an admin key reads both in full. Fails on the old
    code (a 200 with both tenants for the probe's key)."""
    cfg = _a_and_b({"k-a": "a", "k-b": "b"}, frozenset({"k-admin"}))
    runner, url = await server.start(cfg)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def get(path: str, key: str | None) -> tuple[int, str]:
                head = {} if key is None else {"Authorization": f"Bearer {key}"}
                async with session.get(f"{url}{path}", headers=head) as r:
                    return r.status, await r.text()

            body = {"prompt": list(range(1, 30)), "max_tokens": 2, "temperature": 0}
            head = {"Authorization": "Bearer k-a"}
            async with session.post(f"{url}/v1/completions", json=body, headers=head) as r:
                assert r.status == 200
            status, text = await get("/stats", "k-b")
            assert status == 200
            got = json.loads(text)
            assert got["tenant"] == "b" and got["prompt_tokens"] == 0, got
            assert '"a"' not in text and "store" not in got
            for key in (None, "k-nobody"):
                assert (await get("/stats", key))[0] == 401
                assert (await get("/metrics", key))[0] == 401
            status, text = await get("/metrics", "k-b")
            assert status == 403 and "admin" in text
            status, text = await get("/stats", "k-admin")
            assert status == 200 and set(json.loads(text)["store"]["tenants"]) == {"a", "b"}
            status, text = await get("/metrics", "k-admin")
            assert status == 200 and 'tenant="a"' in text
    finally:
        await runner.cleanup()


def test_admin_keys_are_checked() -> None:
    """Admin keys are non-empty strings, never a tenant's key, and only beside API keys."""
    with pytest.raises(InvalidInputError):
        server.ServerConfig(api_keys={"k": "a"}, admin_keys=frozenset({"k"}))
    with pytest.raises(InvalidTypeError):
        server.ServerConfig(admin_keys={"k"})  # type: ignore[arg-type]


async def test_the_bearer_scheme_is_any_case_and_a_body_tenant_must_match_the_key() -> None:
    """The auth scheme is case-insensitive (RFC 9110): ``bearer KEY`` was a 401. And with API
    keys, a body's ``tenant`` naming another tenant was silently overruled by the key; now it
    is a 400 (the key's own name is accepted). Both fail on the old code."""
    cfg = _a_and_b({"k-a": "a"})
    runner, url = await server.start(cfg)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def ask(auth: str, **extra: Any) -> int:
                body = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, **extra}
                head = {"Authorization": auth}
                async with session.post(f"{url}/v1/completions", json=body, headers=head) as r:
                    return r.status

            assert await ask("bearer k-a") == 200
            assert await ask("BEARER k-a") == 200
            assert await ask("Bearer k-a", tenant="a") == 200
            assert await ask("Bearer k-a", tenant="b") == 400
            assert await ask("Basic k-a") == 401
    finally:
        await runner.cleanup()
