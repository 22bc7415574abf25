"""Tenants in the example server (issue 29): ``cache_salt`` as vLLM's OpenAI server takes it
(a request reuses cached prefixes of its own salt only), bad salts are 400s."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tierkv.errors import InvalidInputError
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
            async with session.get(f"{url}/stats") as r:
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
