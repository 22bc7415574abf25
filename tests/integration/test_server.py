"""The example HTTP server: concurrent requests, prefix reuse across requests, /metrics, /stats."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv import KVStore
from tierkv.demo.model import ModelConfig, TinyLlama

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SERVER_PY = Path(__file__).resolve().parents[2] / "examples" / "server.py"


def _load_server() -> Any:
    spec = importlib.util.spec_from_file_location("tierkv_example_server", SERVER_PY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


server = _load_server()
MODEL = ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3)
# 4 requests of 48 + 8 tokens need 4 x 7 blocks x 2 layers = 56 pages: more than the device holds
CFG = server.ServerConfig(model=MODEL, page_tokens=8, device_pages=40, host_pages=1024)
SYSTEM, USER, NEW = 40, 8, 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; oversubscribed threads only slow it down
    yield
    torch.set_num_threads(n)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Any]]:
    runner, url = await server.start(CFG)
    timeout = aiohttp.ClientTimeout(total=20)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield url, session
    finally:
        await runner.cleanup()


async def generate(session: Any, url: str, prompt: list[int], n: int = NEW) -> dict[str, Any]:
    async with session.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": n}) as r:
        assert r.status == 200, await r.text()
        result: dict[str, Any] = await r.json()
        return result


async def cold(prompt: list[int], n: int = NEW) -> list[int]:
    """The same prompt on a fresh store: nothing reused."""
    spec = MODEL.kv_spec(CFG.kv_dtype, CFG.page_tokens)
    async with KVStore(
        spec, device_bytes=256 * spec.page_bytes, host_bytes=1024 * spec.page_bytes, codec=None
    ) as store:
        gen = server.Generator(store, TinyLlama(MODEL, spec.dtype))
        result = await gen.generate(prompt, n)
    assert result["reused_tokens"] == 0
    tokens: list[int] = result["tokens"]
    return tokens


def ids(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(MODEL.vocab) for _ in range(n)]


async def test_concurrent_requests_reuse_a_shared_system_prompt(
    served: tuple[str, Any],
) -> None:
    url, session = served
    rnd = random.Random(0)
    # four distinct prompts at once: all computed, all concurrent
    prompts = [ids(rnd, SYSTEM + USER) for _ in range(4)]
    first = await asyncio.gather(*(generate(session, url, p) for p in prompts))
    assert [r["reused_tokens"] for r in first] == [0, 0, 0, 0]
    assert all(len(r["tokens"]) == NEW and r["ttft_ms"] > 0 for r in first)

    # one request leaves the system prompt cached; the next ones load it instead of computing it
    system = ids(rnd, SYSTEM)
    prime = await generate(session, url, system + ids(rnd, USER))
    assert prime["reused_tokens"] == 0
    warm_prompts = [system + ids(rnd, USER) for _ in range(3)]
    warm = await asyncio.gather(*(generate(session, url, p) for p in warm_prompts))
    for r in warm:
        assert r["prefix_reused"] and r["reused_tokens"] == SYSTEM  # 5 full blocks of 8
        assert r["computed_prompt_tokens"] == USER
    assert warm[0]["tokens"] == await cold(warm_prompts[0])
    assert first[0]["tokens"] == await cold(prompts[0])

    async with session.get(f"{url}/stats") as r:
        stats = await r.json()
    assert stats["server"]["served"] == 8
    assert stats["server"]["in_flight"] == 0
    assert stats["server"]["peak_in_flight"] >= 3  # the requests did overlap
    assert stats["prefix_tokens_reused"] == 3 * SYSTEM
    assert stats["written_back"] > 0  # the KV did not fit the device tier
    assert stats["background_errors"] == 0

    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("tierkv_prefix_tokens_reused_total", ())] == 3 * SYSTEM
    assert samples[("tierkv_store_open", ())] == 1
    assert samples[("tierkv_server_requests_total", (("status", "ok"),))] == 8
    assert samples[("tierkv_server_ttft_seconds_count", (("prefix_reused", "true"),))] == 3
    assert samples[("tierkv_pinned_pages", (("tier", "device"),))] == 0


async def test_bad_requests_get_400(served: tuple[str, Any]) -> None:
    url, session = served
    bad: list[dict[str, Any]] = [
        {"prompt": "x"},
        {"prompt": [MODEL.vocab]},
        {"prompt": []},
        {"text": "hi", "max_tokens": 0},
        {"max_tokens": 3},
        {"prompt": [1] * 400, "max_tokens": 16},  # more pages than the device tier holds
    ]
    for body in bad:
        async with session.post(f"{url}/generate", json=body) as r:
            assert r.status == 400, body
            assert "error" in await r.json()
    async with session.post(f"{url}/generate", data=b"{not json") as r:
        assert r.status == 400
    result = await generate(session, url, [ord(c) % MODEL.vocab for c in "hello"], 2)
    async with session.post(f"{url}/generate", json={"text": "hello", "max_tokens": 2}) as r:
        assert (await r.json())["tokens"] == result["tokens"]
