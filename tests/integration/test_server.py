"""The OpenAI-compatible example server on the tiny model: the endpoints, streaming, stop
strings, prefix reuse across requests, /metrics, errors in OpenAI's shape, and the command line
on a free loopback port."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.demo.model import ModelConfig
from tierkv.serving import EngineConfig, SamplingParams, TinyModel

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVER_PY = ROOT / "examples" / "server.py"


def _load_server() -> Any:
    spec = importlib.util.spec_from_file_location("tierkv_example_server", SERVER_PY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


server = _load_server()
MODEL = ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3)
ENGINE = EngineConfig(max_running=4, page_tokens=8, max_context=256)
CFG = server.ServerConfig(model="tiny", tiny=MODEL, engine=ENGINE, max_tokens=64)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Any]]:
    runner, url = await server.start(CFG)
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield url, session
    finally:
        await runner.cleanup()


async def post(session: Any, url: str, path: str, body: Any) -> tuple[int, Any]:
    async with session.post(f"{url}{path}", json=body) as r:
        return r.status, await r.json()


async def sse(session: Any, url: str, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with session.post(f"{url}{path}", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: "):
                data = text[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def reference(prompt: list[int], n: int) -> list[int]:
    from tierkv.serving import Engine

    async with Engine(TinyModel(MODEL), ENGINE) as e:
        tokens, _ = await e.complete(prompt, SamplingParams(max_tokens=n))
    return tokens


def decode(ids: list[int]) -> str:
    from tierkv.serving import CharTokenizer

    return CharTokenizer(MODEL.vocab).decode(ids)


async def test_models_health_and_a_greedy_completion(served: tuple[str, Any]) -> None:
    url, session = served
    async with session.get(f"{url}/v1/models") as r:
        models = await r.json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["object"] == "list"
    async with session.get(f"{url}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    prompt = [5, 6, 7, 8, 9]
    status, body = await post(
        session,
        url,
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0},
    )
    assert status == 200, body
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == decode(await reference(prompt, 6))
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_streams_server_sent_events(served: tuple[str, Any]) -> None:
    url, session = served
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
    status, whole = await post(session, url, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    text = whole["choices"][0]["message"]["content"]
    events = await sse(session, url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_stop_strings_cut_the_text(served: tuple[str, Any]) -> None:
    url, session = served
    base = {"prompt": "abcdefgh", "max_tokens": 12, "temperature": 0}
    _, full = await post(session, url, "/v1/completions", base)
    text = full["choices"][0]["text"]
    stop = text[4:6]
    cut = text[: text.index(stop)]
    _, got = await post(session, url, "/v1/completions", {**base, "stop": [stop]})
    assert got["choices"][0] == {
        "index": 0,
        "text": cut,
        "logprobs": None,
        "finish_reason": "stop",
    }
    events = await sse(session, url, "/v1/completions", {**base, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_a_shared_prefix_is_reused_and_counted(served: tuple[str, Any]) -> None:
    url, session = served
    rnd = random.Random(1)
    system = [rnd.randrange(MODEL.vocab) for _ in range(40)]
    users = [[rnd.randrange(MODEL.vocab) for _ in range(6)] for _ in range(4)]
    req = {"max_tokens": 4, "temperature": 0}
    _, first = await post(session, url, "/v1/completions", {**req, "prompt": system + users[0]})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    rest = await asyncio.gather(
        *(post(session, url, "/v1/completions", {**req, "prompt": system + u}) for u in users[1:])
    )
    for status, body in rest:
        assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert rest[0][1]["choices"][0]["text"] == decode(await reference(system + users[1], 4))
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("tierkv_prefix_tokens_reused_total", ())] == 3 * 40
    assert samples[("tierkv_server_cached_prompt_tokens", ())] == 3 * 40
    assert samples[("tierkv_server_device_peak_bytes", ())] > 0
    assert samples[("tierkv_server_live_kv_peak_bytes", ())] > 0
    key = ("tierkv_server_requests_total", (("route", "/v1/completions"), ("status", "200")))
    assert samples[key] == 4
    assert samples[("tierkv_server_ttft_seconds_count", ())] == 4
    async with session.get(f"{url}/stats") as r:
        stats = await r.json()
    assert stats["finished"] == 4 and stats["running"] == 0
    assert stats["store"]["background_errors"] == 0


async def test_errors_have_the_openai_shape(served: tuple[str, Any]) -> None:
    url, session = served
    bad: list[tuple[str, Any, int, str | None]] = [
        ("/v1/completions", {"prompt": [1] * 300}, 400, "prompt"),  # longer than the context
        ("/v1/completions", {"prompt": "x" * 250, "max_tokens": 10}, 400, "prompt"),
        ("/v1/completions", {"prompt": [MODEL.vocab]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, None),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, None),
        ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", [1, 2], 400, None),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ]
    for path, body, code, param in bad:
        status, got = await post(session, url, path, body)
        assert status == code, (body, got)
        err = got["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], got
        if param is not None:
            assert err["param"] == param, (body, got)
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (b"{not json", b"\xff\xfe", deep):  # not JSON; not UTF-8; nested too deep
        async with session.post(f"{url}/v1/completions", data=raw) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_json"
    async with session.get(f"{url}/v1/nothing") as r:
        assert r.status == 404 and "error" in await r.json()
    async with session.get(f"{url}/v1/completions") as r:
        assert r.status == 405 and "error" in await r.json()
    # the server still answers
    status, ok = await post(session, url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


async def test_a_client_that_leaves_frees_its_request() -> None:
    from tierkv.serving import CharTokenizer

    class Slow(TinyModel):
        def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
            time.sleep(0.01)  # 60 tokens take over a second: the client leaves well before
            return super().finish(layer, x, att)

    runner, url = await server.start(CFG, loaded=(Slow(MODEL), CharTokenizer(MODEL.vocab)))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            body = {"prompt": "abc", "max_tokens": 60, "temperature": 0, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                await r.content.readline()  # one event, then hang up
            # a non-streamed request whose client gives up
            short = aiohttp.ClientTimeout(total=0.3)
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=short) as s2:
                    await post(s2, url, "/v1/completions", {"prompt": "abc", "max_tokens": 60})
            for _ in range(200):
                async with session.get(f"{url}/stats") as r:
                    stats = await r.json()
                if stats["cancelled"] == 2 and stats["running"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats["cancelled"] == 2 and stats["running"] == 0 and stats["waiting"] == 0
            assert stats["generated_tokens"] < 60  # neither ran to its end
    finally:
        await runner.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_command_line_serves_on_a_loopback_port() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(SERVER_PY), "--model", "tiny", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:

        async def talk() -> dict[str, Any]:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        async with s.get(f"{url}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        assert time.monotonic() < deadline, "the server did not start"
                        assert proc.poll() is None, "the server exited"
                        await asyncio.sleep(0.2)
                status, body = await post(
                    s, url, "/v1/completions", {"prompt": "hi", "max_tokens": 3}
                )
                assert status == 200
                result: dict[str, Any] = body
                return result

        body = asyncio.run(talk())
        assert body["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(10)


def _docs_checker() -> Any:
    path = ROOT / "tests" / "tierkv" / "test_docs_config.py"
    spec = importlib.util.spec_from_file_location("tierkv_docs_config_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_serving_flags_and_options_are_documented() -> None:
    docs = _docs_checker()
    got = docs.sections()
    load = importlib.util.spec_from_file_location(
        "tierkv_example_load", ROOT / "examples" / "load.py"
    )
    assert load is not None and load.loader is not None
    load_mod = importlib.util.module_from_spec(load)
    sys.modules[load.name] = load_mod  # (its dataclasses look their module up)
    load.loader.exec_module(load_mod)
    for title, parser in (
        ("examples/server.py", server.build_parser()),
        ("examples/load.py", load_mod.build_parser()),
    ):
        want = {
            max(a.option_strings, key=len): docs.cli_default(a)
            for a in parser._actions
            if a.option_strings and a.dest != "help"
        }
        assert got.get(title) == want, title
    assert got["EngineConfig"] == docs.python_options(EngineConfig)


async def test_a_failed_step_is_a_503_in_openai_shape() -> None:
    from tierkv.serving import CharTokenizer

    class Flaky(TinyModel):
        fail = 0
        skip = 0  # layer calls that succeed before the failing one

        def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
            if self.fail and self.skip:
                self.skip -= 1
            elif self.fail:
                self.fail -= 1
                raise RuntimeError("boom")
            return super().finish(layer, x, att)

    model = Flaky(MODEL)
    runner, url = await server.start(CFG, loaded=(model, CharTokenizer(MODEL.vocab)))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            model.fail = 1
            status, body = await post(session, url, "/v1/completions", {"prompt": "hi"})
            assert status == 503 and body["error"]["type"] == "server_error"
            assert "boom" in body["error"]["message"]
            model.fail = 1  # streamed, failing before its first token: the same 503
            status, body = await post(
                session, url, "/v1/completions", {"prompt": "hi", "stream": True}
            )
            assert status == 503 and "boom" in body["error"]["message"]
            model.fail, model.skip = 1, 2 * MODEL.layers  # after its first token: in the stream
            events = await sse(session, url, "/v1/completions", {"prompt": "hi"})
            assert events[0]["choices"][0]["text"]  # the first token went out
            assert "boom" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
            status, body = await post(session, url, "/v1/completions", {"prompt": "hi"})
            assert status == 200
    finally:
        await runner.cleanup()
