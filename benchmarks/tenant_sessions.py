"""Tenants in the shared tiers (issue 29): what a tenant's session costs, and what a probe
tenant learns from another tenant's pages.

    python benchmarks/tenant_sessions.py [--quick] [--rounds N] [--json FILE]

Page server (one in this process, tenants acme and probe, over tcp and shm): acme and the
default secret both hold one prompt of 256 pages; then, rounds interleaved:

- **overhead**: lookup + load of the prompt as acme vs as the default session (median ms;
  ratio target <= 1.03: the tenant's keys are derived and its reads guarded, nothing else);
- **probe** (a loop of its own): the probe tenant sends acme's exact prompt and a never-seen
  one (lookup + load): pages it gets of acme's (target 0) and the time of acme's prompt over
  the never-seen one's (median; target 1 within noise).

Redis (a private redis-server, when one is on PATH): acme publishes the prompt; the probe's
RedisTier (tenant "probe") looks acme's prompt and a never-seen one up: hits (target 0) and
the time ratio, as above. Prints a table; ``--json`` writes ``{"figures", "ratios"}``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from redis_server import RedisServer, redis_binary

from benchmarks._common import parser, table, write_json
from tierkv import KVStore
from tierkv.remote import PageServer, RedisTier, RemoteTier
from tierkv.spec import KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
PAGE = SPEC.page_bytes
DEFAULT, ACME, PROBE = (
    b"bench-default-secret-01",
    b"bench-acme-secret-0001",
    b"bench-probe-secret-001",
)
SECRETS = {"acme": ACME, "probe": PROBE}


def prompt(seed: int, n: int) -> list[bytes]:
    """``n`` content page keys (18 bytes, content bit clear) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [bytes([rng.integers(0, 128)]) + rng.bytes(17) for _ in range(n)]


async def timed(rounds: int, calls: dict[str, Callable[[], Awaitable[int]]]) -> dict[str, Any]:
    """Each call ``rounds`` times, interleaved (the order alternating); per call its median
    ms and its largest answer (pages)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    got = dict.fromkeys(calls, 0)
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 else names[::-1]:
            start = time.perf_counter()
            got[name] = max(got[name], await calls[name]())
            times[name].append(time.perf_counter() - start)
    return {k: {"ms": statistics.median(v) * 1e3, "pages": got[k]} for k, v in times.items()}


async def page_server(kind: str, n: int, rounds: int) -> dict[str, Any]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=(2 * n + 8) * PAGE, codec=None)
    keys, never = prompt(1, n), prompt(2, n)
    pages = np.random.default_rng(3).integers(0, 256, (n, PAGE), np.uint8)
    slots, out = list(range(n)), np.zeros_like(pages)
    kw: dict[str, Any] = {"transport": kind, "spec": SPEC, "timeout": 30.0}
    async with (
        store,
        PageServer(store, transports=[kind], secret=DEFAULT, secrets=SECRETS) as srv,
        RemoteTier(srv.address, secret=ACME, tenant="acme", **kw) as acme,
        RemoteTier(srv.address, secret=DEFAULT, **kw) as plain,
        RemoteTier(srv.address, secret=PROBE, tenant="probe", **kw) as probe,
    ):
        assert await acme.publish(keys, pages, slots) == n
        assert await plain.publish(keys, pages, slots) == n

        def load(peer: RemoteTier, ks: list[bytes]) -> Callable[[], Awaitable[int]]:
            async def go() -> int:
                await peer.lookup(ks)
                return await peer.load(ks, out, slots)

            return go

        # two loops: a probe right after a load would pay for the load's tail (its release,
        # the server's loop catching up), whichever prompt it sent
        loads = await timed(rounds, {"tenant": load(acme, keys), "default": load(plain, keys)})
        probes = {"probe_other": load(probe, keys), "probe_never": load(probe, never)}
        return {**loads, **await timed(rounds, probes)}


async def redis(n: int, rounds: int) -> dict[str, Any] | None:
    if redis_binary() is None:
        return None
    keys, never = prompt(1, n), prompt(2, n)
    pages = np.random.default_rng(3).integers(0, 256, (n, PAGE), np.uint8)
    with RedisServer(args=["--maxmemory-policy", "allkeys-lru"]) as srv:
        async with (
            RedisTier(srv.url, spec=SPEC, tenant="acme") as acme,
            RedisTier(srv.url, spec=SPEC, tenant="probe") as probe,
        ):
            assert await acme.publish(keys, pages, list(range(n))) == n

            def look(ks: list[bytes]) -> Callable[[], Awaitable[int]]:
                return lambda: probe.lookup(ks)

            return await timed(rounds, {"probe_other": look(keys), "probe_never": look(never)})


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=None, help="rounds per figure (default 300)")
    args = p.parse_args()
    rounds = args.rounds or (40 if args.quick else 300)
    n = 64 if args.quick else 256
    figures: dict[str, Any] = {"pages": n, "page_bytes": PAGE, "rounds": rounds}
    ratios: dict[str, Any] = {}
    rows = []
    for kind in ("tcp", "shm"):
        f = asyncio.run(page_server(kind, n, rounds))
        figures[kind] = f
        ratios[f"{kind}_tenant_over_default"] = f["tenant"]["ms"] / f["default"]["ms"]
        ratios[f"{kind}_probe_hits"] = f["probe_other"]["pages"]
        ratios[f"{kind}_probe_other_over_never"] = f["probe_other"]["ms"] / f["probe_never"]["ms"]
        rows.append([f"page server {kind}", *(f[k]["ms"] for k in f), f["probe_other"]["pages"]])
    r = asyncio.run(redis(n, rounds))
    if r is not None:
        figures["redis"] = r
        ratios["redis_probe_hits"] = r["probe_other"]["pages"]
        ratios["redis_probe_other_over_never"] = r["probe_other"]["ms"] / r["probe_never"]["ms"]
        rows.append(["redis", "", "", *(r[k]["ms"] for k in r), r["probe_other"]["pages"]])
    heads = ["tier", "tenant ms", "default ms", "probe: other's ms", "never-seen ms", "hits"]
    print(table(heads, rows))
    print("ratios (targets: tenant/default <= 1.03, probe hits 0, other/never ~ 1):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
