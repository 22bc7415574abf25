"""An OpenAI-compatible load generator: concurrent streamed completions, time to first token,
time per output token, tokens/s, prefix tokens reused and the server's device-tier peak.

::

    python examples/server.py --model smollm2 --listen 127.0.0.1:8080 &
    python examples/load.py --url http://127.0.0.1:8080 --concurrency 8 --requests 16 \\
        --system 1000 --shared 1.0 --user 32 --max-tokens 32
    python examples/load.py                  # starts a tiny-model server in this process

Each request is a system part plus a user part, sent as token ids to ``/v1/completions`` with
``stream: true`` and ``temperature: 0``. A fraction ``--shared`` of the requests share one
system part (which one earlier request, not counted, leaves in the server's cache); the others
get a system part of their own. ``--concurrency`` workers send ``--requests`` in all, each
waiting for its previous answer. Works against any server with that API (``--vocab`` bounds the
random ids); the prefix and device-tier figures come from a tierkv server's ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank; 0 when empty)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class LoadSpec:
    """One load: how many requests, how alike, how long."""

    concurrency: int = 8
    requests: int = 16
    system: int = 256
    shared: float = 1.0
    user: int = 16
    max_tokens: int = 16
    vocab: int = 2000
    seed: int = 0
    warmup: bool = True


@dataclass
class Sample:
    """One request's timings (client side)."""

    ttft: float
    total: float
    tokens: int
    cached: int


async def stream_one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, model: str
) -> Sample:
    """Send one streamed completion; returns its timings. Raises RuntimeError on an error."""
    body: dict[str, Any] = {"model": model} if model else {}
    body |= {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if ttft is None and event["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        ttft if ttft is not None else total,
        total,
        int(usage.get("completion_tokens", 0)),
        int(details.get("cached_tokens", 0)),
    )


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The unlabelled ``tierkv_server_*`` gauges of ``/metrics`` (empty when there are none)."""
    try:
        async with session.get(f"{url}/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tierkv_") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


async def run_load(
    url: str, spec: LoadSpec, model: str = "", progress: bool = True
) -> dict[str, Any]:
    """Run one load against ``url``; returns its figures."""
    rnd = random.Random(spec.seed)

    def ids(n: int) -> list[int]:
        return [rnd.randrange(1, spec.vocab) for _ in range(n)]

    shared = ids(spec.system)
    prompts = [
        (shared if rnd.random() < spec.shared else ids(spec.system)) + ids(spec.user)
        for _ in range(spec.requests)
    ]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if not model:
            async with session.get(f"{url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        if spec.warmup and spec.shared > 0:
            await stream_one(session, url, shared + ids(spec.user), 1, model)
        before = await scrape(session, url)
        queue = list(enumerate(prompts))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                _, prompt = queue.pop(0)
                samples.append(await stream_one(session, url, prompt, spec.max_tokens, model))
                if progress:
                    print(f"\r  {len(samples)}/{len(prompts)} requests", end="", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        wall = time.perf_counter() - t0
        if progress:
            print(file=sys.stderr)
        after = await scrape(session, url)
    ttft = [s.ttft for s in samples]
    tpot = [(s.total - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples),
        "concurrency": spec.concurrency,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefix_tokens_reused": sum(s.cached for s in samples),
        "device_peak_bytes": after.get("tierkv_server_device_peak_bytes", 0.0),
        "device_capacity_bytes": after.get("tierkv_server_device_capacity_bytes", 0.0),
        "live_kv_peak_bytes": after.get("tierkv_server_live_kv_peak_bytes", 0.0),
        "server_reused_tokens": after.get("tierkv_server_cached_prompt_tokens", 0.0)
        - before.get("tierkv_server_cached_prompt_tokens", 0.0),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        # time per output token as the server made them (its engine's clock: no client loop)
        "server_tpot_s": _delta(after, before, "tierkv_server_decode_seconds")
        / max(1.0, _delta(after, before, "tierkv_server_decode_tokens")),
    }


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def load_server_module() -> Any:
    """``examples/server.py`` as a module (to serve in this process)."""
    path = Path(__file__).with_name("server.py")
    spec = importlib.util.spec_from_file_location("tierkv_example_server", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def report(res: dict[str, Any]) -> str:
    """The figures as lines of text."""
    mib = 1 << 20
    return "\n".join(
        [
            f"requests          {res['requests']} at concurrency {res['concurrency']}",
            f"TTFT p50 / p99    {res['ttft_p50_s'] * 1e3:.1f} / {res['ttft_p99_s'] * 1e3:.1f} ms",
            f"time per token    {res['tpot_p50_s'] * 1e3:.1f} ms (p50)",
            f"output tokens/s   {res['tokens_per_s']:.1f}",
            f"prefix reused     {res['prefix_tokens_reused']} of {res['prompt_tokens']} tokens",
            f"device-tier peak  {res['device_peak_bytes'] / mib:.1f} MiB "
            f"(budget {res['device_capacity_bytes'] / mib:.1f} MiB, "
            f"live KV peak {res['live_kv_peak_bytes'] / mib:.1f} MiB)",
        ]
    )


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    spec = LoadSpec(
        concurrency=a.concurrency,
        requests=a.requests,
        system=a.system,
        shared=a.shared,
        user=a.user,
        max_tokens=a.max_tokens,
        vocab=a.vocab,
        seed=a.seed,
    )
    if a.url is not None:
        return await run_load(a.url, spec)
    server = load_server_module()
    runner, url = await server.start(server.ServerConfig())
    print(f"tiny-model server on {url} (in this process)", file=sys.stderr)
    try:
        return await run_load(url, spec)
    finally:
        await runner.cleanup()


def build_parser() -> argparse.ArgumentParser:
    """The command line (documented in docs/configuration.md)."""
    d = LoadSpec()
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--url", help="a running server (default: a tiny-model one, in this process)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in all")
    p.add_argument("--system", type=int, default=d.system, help="system-part tokens")
    p.add_argument(
        "--shared", type=float, default=d.shared, help="fraction sharing one system part"
    )
    p.add_argument("--user", type=int, default=d.user, help="user-part tokens")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    p.add_argument("--vocab", type=int, default=d.vocab, help="random ids are below this")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random prompts")
    p.add_argument("--threads", type=int, default=1, help="torch threads (in-process server)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what cannot run, before the load (``--vocab 0`` was a ValueError from random,
    ``--requests 0`` and ``--concurrency 0`` ran nothing, ``--max-tokens 0`` an HTTP 400
    traceback, a ``--json`` in a missing folder failed after the whole run)."""
    for flag, least in (
        ("concurrency", 1),
        ("requests", 1),
        ("system", 0),
        ("user", 0),
        ("max_tokens", 1),
        ("vocab", 1),
        ("threads", 1),
    ):
        if getattr(a, flag) < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(a, flag)}")
    if a.system + a.user < 1:
        p.error("--system and --user are both 0: a prompt needs a token")
    if not 0.0 <= a.shared <= 1.0:
        p.error(f"--shared must be a fraction in [0, 1], got {a.shared}")
    if a.json and not Path(a.json).resolve().parent.is_dir():
        p.error(f"--json {a.json}: its folder does not exist")


def main() -> None:
    p = build_parser()
    a = p.parse_args()
    check_args(p, a)
    if a.url is None:
        import torch

        torch.set_num_threads(a.threads)
    res = asyncio.run(amain(a))
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
