"""An HTTP generate server: concurrent requests share one KVStore and the demo model (aiohttp).

::

    python examples/server.py --port 8080            # loopback only by default
    curl -s localhost:8080/generate -d '{"text": "You are terse. Hi!", "max_tokens": 8}'
    curl -s localhost:8080/metrics                   # Prometheus exposition
    curl -s localhost:8080/stats                     # the store's figures as JSON

``POST /generate`` takes ``{"prompt": [token ids]}`` or ``{"text": "..."}`` (one id per character)
and ``"max_tokens"``; it answers the greedy tokens and timings: time to first token, and how many
prompt tokens were reused from the cache. A request whose prompt starts like an earlier one (the
same system prompt) loads that prefix's KV from the store instead of recomputing it:
``store.add_sequence`` returns the reused tokens and only the rest of the prompt is run.

Each request is its own asyncio task with its own leases. The model computes on the event-loop
thread, so a FIFO lock hands out one forward pass (a prefill or one decode token) at a time; the
requests waiting for the lock are announced to the store (``schedule``), which prefetches their
pages while the current one computes.

The cold pool is off by default (``--codec none``): a cached prefix compressed with a lossy codec
comes back approximately, and a warm request's tokens could then differ from a cold computation.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from tierkv import KVStore, TierFullError, metrics
from tierkv.demo.model import KVProvider, ModelConfig, TinyLlama


@dataclass(frozen=True)
class ServerConfig:
    """What the server is built from (the defaults keep KV larger than the device tier)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kv_dtype: str = "fp16"
    page_tokens: int = 16
    device_pages: int = 512
    host_pages: int = 16384
    codec: str | None = None
    max_tokens: int = 256
    max_prompt: int = 4096
    trace: str | None = None


class Generator:
    """Greedy generation for concurrent requests over one store and one model."""

    def __init__(self, store: KVStore, model: TinyLlama) -> None:
        self.store = store
        self.model = model
        self._turn = asyncio.Lock()  # FIFO: requests take turns, one forward pass each
        self._waiting: dict[str, None] = {}  # ids waiting for the lock, in order
        self._ids = itertools.count()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.served = 0

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy tokens of ``prompt`` and timings; the prompt's cached prefix is reused.

        Raises ValueError for an empty prompt, ``max_tokens < 1``, or a sequence whose pages
        cannot all fit the device tier.
        """
        if not prompt or max_tokens < 1:
            raise ValueError("need a non-empty prompt and max_tokens >= 1")
        store = self.store
        spec = store.spec
        need = spec.blocks_for(len(prompt) + max_tokens) * spec.num_layers
        room = store.tiers.table.capacity("device")
        if need > room:  # a forward pass leases every layer of the sequence at once
            raise ValueError(
                f"prompt + max_tokens need {need} device pages, the device tier holds {room}"
            )
        sid = f"req{next(self._ids)}"
        t0 = time.perf_counter()
        reused = await store.add_sequence(sid, prompt)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        out: list[int] = []
        ttft = 0.0
        try:
            feed, pos = prompt[reused:], reused
            while len(out) < max_tokens:
                tok = await self._forward(sid, feed, pos)
                if not out:
                    ttft = time.perf_counter() - t0
                out.append(tok)
                pos += len(feed)
                feed = [tok]
        finally:
            self.in_flight -= 1
            await store.release(sid)
        total = time.perf_counter() - t0
        self.served += 1
        return {
            "id": sid,
            "tokens": out,
            "prompt_tokens": len(prompt),
            "reused_tokens": reused,
            "prefix_reused": reused > 0,
            "computed_prompt_tokens": len(prompt) - reused,
            "ttft_ms": ttft * 1e3,
            "total_ms": total * 1e3,
        }

    async def _forward(self, sid: str, tokens: list[int], start: int) -> int:
        store = self.store
        self._waiting[sid] = None
        try:
            async with self._turn:
                del self._waiting[sid]
                # the requests queued behind this one run next: load their pages meanwhile
                store.schedule([[s] for s in self._waiting])
                t0 = time.perf_counter()
                async with store.lease([sid]) as lease:

                    async def gate(layer: int) -> KVProvider:
                        return lease

                    logits = await self.model.forward(sid, tokens, start, gate)
                tok = int(logits.argmax())
                store.add_tokens(sid, [tok])
                store.timeline.span("forward", "compute", t0, time.perf_counter(), seq=sid)
                store.step()
                return tok
        finally:
            self._waiting.pop(sid, None)


GENERATOR = web.AppKey("generator", Generator)
CONFIG = web.AppKey("config", ServerConfig)


def parse_request(body: Any, cfg: ServerConfig) -> tuple[list[int], int]:
    """``(prompt ids, max_tokens)`` of a /generate body. Raises ValueError when malformed."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    vocab = cfg.model.vocab
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt
        ):
            raise ValueError(f"prompt must be a list of token ids in [0, {vocab})")
    elif isinstance(body.get("text"), str):
        prompt = [ord(c) % vocab for c in body["text"]]
    else:
        raise ValueError('give "prompt" (token ids) or "text"')
    if not 0 < len(prompt) <= cfg.max_prompt:
        raise ValueError(f"prompt length must be in [1, {cfg.max_prompt}]")
    n = body.get("max_tokens", 16)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= cfg.max_tokens:
        raise ValueError(f"max_tokens must be an int in [1, {cfg.max_tokens}]")
    return prompt, n


class _ServerMetrics:
    """Request counts and time to first token (the store's own figures come from metrics.py)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tierkv_server_requests", "Generate requests", ["status"], registry=self.registry
        )
        self.ttft = Histogram(
            "tierkv_server_ttft_seconds",
            "Time to first token",
            ["prefix_reused"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )


SERVER_METRICS = web.AppKey("server_metrics", _ServerMetrics)


async def handle_generate(request: web.Request) -> web.Response:
    app = request.app
    sm = app[SERVER_METRICS]
    try:
        prompt, n = parse_request(await request.json(), app[CONFIG])
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        sm.requests.labels("bad_request").inc()
        return web.json_response({"error": str(exc)}, status=400)
    try:
        result = await app[GENERATOR].generate(prompt, n)
    except ValueError as exc:
        sm.requests.labels("bad_request").inc()
        return web.json_response({"error": str(exc)}, status=400)
    except TierFullError as exc:  # the device is pinned full by other requests right now
        sm.requests.labels("busy").inc()
        return web.json_response({"error": str(exc)}, status=503)
    sm.requests.labels("ok").inc()
    sm.ttft.labels(str(result["prefix_reused"]).lower()).observe(result["ttft_ms"] / 1e3)
    return web.json_response(result)


async def handle_stats(request: web.Request) -> web.Response:
    gen = request.app[GENERATOR]
    stats = gen.store.stats()
    stats["server"] = {
        "in_flight": gen.in_flight,
        "peak_in_flight": gen.peak_in_flight,
        "served": gen.served,
    }
    return web.json_response(stats)


async def handle_metrics(request: web.Request) -> web.Response:
    app = request.app
    body = metrics.render(app[GENERATOR].store) + generate_latest(app[SERVER_METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(cfg: ServerConfig | None = None) -> web.Application:
    """The aiohttp application; the store opens at startup and closes at cleanup."""
    cfg = cfg or ServerConfig()
    app = web.Application()
    app[CONFIG] = cfg
    app[SERVER_METRICS] = _ServerMetrics()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        spec = cfg.model.kv_spec(cfg.kv_dtype, cfg.page_tokens)
        store = KVStore(
            spec,
            device_bytes=cfg.device_pages * spec.page_bytes,
            host_bytes=cfg.host_pages * spec.page_bytes,
            codec=cfg.codec,
        )
        await store.open()
        store.timeline.enabled = cfg.trace is not None
        app[GENERATOR] = Generator(store, TinyLlama(cfg.model, spec.dtype))
        try:
            yield
        finally:
            await store.close()
            if cfg.trace:
                store.timeline.write(cfg.trace)

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/generate", handle_generate)
    app.router.add_get("/stats", handle_stats)
    app.router.add_get("/metrics", handle_metrics)
    return app


async def start(
    cfg: ServerConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Serve in this process; returns the runner (``await runner.cleanup()`` stops it) and the
    base URL (``port=0``: an ephemeral port)."""
    runner = web.AppRunner(make_app(cfg), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addr = runner.addresses[0]
    return runner, f"http://{addr[0]}:{addr[1]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device-pages", type=int, default=ServerConfig.device_pages)
    p.add_argument("--host-pages", type=int, default=ServerConfig.host_pages)
    p.add_argument("--codec", default="none", help="cold-pool codec (none, int8, ...)")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace at shutdown")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the model")
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    cfg = ServerConfig(
        device_pages=a.device_pages,
        host_pages=a.host_pages,
        codec=None if a.codec == "none" else a.codec,
        trace=a.trace,
    )
    web.run_app(make_app(cfg), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
