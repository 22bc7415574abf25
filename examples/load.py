"""Fire N concurrent generate requests at the example server and report time to first token.

::

    python examples/load.py                      # starts the server in this process (loopback)
    python examples/load.py --url http://127.0.0.1:8080 -n 16 --json load.json

Two rounds of N concurrent requests, each prompt a system prompt plus a short user part:

* ``cold``: every request has its own system prompt, so nothing can be reused;
* ``warm``: every request shares one system prompt, which one earlier request (not counted) has
  left in the cache, so each request loads that prefix's KV instead of computing it.

Prints time to first token (server-side, p50 / p95 / max) per round and the warm / cold ratio.
Every loop is bounded; the script stops by itself.
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
from pathlib import Path
from typing import Any

import aiohttp


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _post(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n: int
) -> dict[str, Any]:
    async with session.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": n}) as r:
        r.raise_for_status()
        result: dict[str, Any] = await r.json()
        return result


async def _round(
    session: aiohttp.ClientSession, url: str, prompts: list[list[int]], n: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_post(session, url, p, n) for p in prompts))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_ms"] for r in results]
    return {
        "requests": len(results),
        "reused_tokens_mean": statistics.fmean(r["reused_tokens"] for r in results),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in results),
        "ttft_ms_p50": _percentile(ttft, 0.5),
        "ttft_ms_p95": _percentile(ttft, 0.95),
        "ttft_ms_max": max(ttft),
        "wall_s": wall,
        "tokens_per_s": sum(len(r["tokens"]) for r in results) / wall,
    }


async def run_load(
    url: str, n: int, system: int, user: int, max_tokens: int, vocab: int, seed: int
) -> dict[str, Any]:
    """Both rounds against ``url``; returns their figures."""
    rnd = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rnd.randrange(vocab) for _ in range(k)]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        out: dict[str, Any] = {}
        print(f"cold: {n} requests, distinct system prompts ({system} + {user} tokens)", flush=True)
        out["cold"] = await _round(
            session, url, [ids(system) + ids(user) for _ in range(n)], max_tokens
        )
        shared = ids(system)
        await _post(session, url, shared + ids(user), 1)  # leaves the system prompt cached
        print(f"warm: {n} requests, one shared system prompt", flush=True)
        out["warm"] = await _round(session, url, [shared + ids(user) for _ in range(n)], max_tokens)
        async with session.get(f"{url}/stats") as r:
            out["store"] = await r.json()
    return out


def _load_server() -> Any:
    path = Path(__file__).with_name("server.py")
    spec = importlib.util.spec_from_file_location("tierkv_example_server", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    runner = None
    url = a.url
    vocab = 2048
    if url is None:
        server = _load_server()
        cfg = server.ServerConfig()
        vocab = cfg.model.vocab
        runner, url = await server.start(cfg)
        print(f"server on {url} (in this process)", flush=True)
    try:
        return await run_load(url, a.n, a.system, a.user, a.max_tokens, vocab, a.seed)
    finally:
        if runner is not None:
            await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one here, on loopback)")
    p.add_argument("-n", type=int, default=16, help="concurrent requests per round")
    p.add_argument("--system", type=int, default=256, help="system prompt tokens")
    p.add_argument("--user", type=int, default=16, help="user tokens per request")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (in-process server)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    res = asyncio.run(amain(a))
    print(f"\n{'round':<6} {'reused':>8} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9} {'tok/s':>8}")
    for name in ("cold", "warm"):
        r = res[name]
        print(
            f"{name:<6} {r['reused_tokens_mean']:>8.0f} {r['ttft_ms_p50']:>9.1f} "
            f"{r['ttft_ms_p95']:>9.1f} {r['ttft_ms_max']:>9.1f} {r['tokens_per_s']:>8.1f}"
        )
    cold, warm = res["cold"], res["warm"]
    print(
        f"\nwarm / cold time to first token: p50 {warm['ttft_ms_p50'] / cold['ttft_ms_p50']:.2f}, "
        f"p95 {warm['ttft_ms_p95'] / cold['ttft_ms_p95']:.2f}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
