"""RedisTier against redis-py used directly, on a redis-server this script starts, in one run.

    python benchmarks/redis_store.py [--quick] [--json FILE] [--plot FILE.png]

For two page sizes (8 KiB; 64 KiB, a Llama-3-8B layer page of 16 fp16 tokens):
  throughput   batch publish / load of N pages in calls of 256 pages, against a straightforward
               redis-py client doing one awaited SET / GET per page of the same bytes.
               Target ratio (tier pages/s over per-page pages/s) >= 1.5.
  prefix 64    one load of a 64-page prefix, against the best of redis-py's pipelined MGETs of
               the same bytes (one MGET; MGETs of 16 in one pipeline; 4 concurrent MGETs of 16).
               Target ratio (tier time over best MGET time) <= 1.5.
  layout       pages per value: 64 pages' bytes as 64 values of 1 page, 16 of 4, 4 of 16
               (pipelined SET, one MGET), to choose page-per-value or packing.
  batch_pages  load and publish of 64 and N pages per (batch_pages, in_flight): the defaults.
Rounds alternate reference and tier so that load from other processes hits both alike; figures
are medians of the rounds. The tier's side includes its checks (header, crc32) and the copy
into a page array; the reference gets raw bytes. Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

# the repository first: benchmarks/transports.py would shadow the transports package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from redis_server import RedisServer

from benchmarks._common import parser, phase, start_trace, table, write_json, write_trace
from tierkv.remote import RedisTier
from tierkv.spec import KVSpec

SPECS = {
    "8KiB": KVSpec(num_layers=32, num_kv_heads=4, head_dim=32, page_tokens=16),
    "64KiB": KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16),
}
CALL_PAGES = 256  # pages per publish / load call in the throughput rows
PREFIX = 64


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


def med(xs: list[float]) -> float:
    return statistics.median(xs)


class Bench:
    """One spec's measurements against one server."""

    def __init__(self, url: str, spec: KVSpec, n: int, rounds: int) -> None:
        self.url, self.spec, self.n, self.rounds = url, spec, n, rounds
        rng = np.random.default_rng(0)
        self.pages = rng.integers(0, 256, (n, spec.page_bytes), np.uint8)
        self.keys = [rng.bytes(18) for _ in range(n)]
        self.raw = [f"raw:{k.hex()}".encode() for k in self.keys]
        self.values = [bytes(p) for p in self.pages]
        self.out = np.zeros_like(self.pages)
        self.r = Redis.from_url(url)

    async def aclose(self) -> None:
        await self.r.aclose()

    # -- throughput ----------------------------------------------------------------------
    async def throughput(self) -> dict[str, float]:
        r, n = self.r, self.n
        t: dict[str, list[float]] = {"naive_put": [], "naive_get": [], "put": [], "get": []}
        async with RedisTier(self.url, spec=self.spec, timeout=30) as rt:
            for _ in range(self.rounds):
                await r.flushdb()

                async def naive_put() -> None:
                    for k, v in zip(self.raw, self.values):
                        await r.set(k, v)

                async def naive_get() -> None:
                    for k in self.raw:
                        assert await r.get(k) is not None

                t["naive_put"].append(await timed(naive_put))
                t["naive_get"].append(await timed(naive_get))
                await r.flushdb()

                async def put() -> None:
                    for i in range(0, n, CALL_PAGES):
                        ks = self.keys[i : i + CALL_PAGES]
                        assert await rt.publish(ks, self.pages, list(range(i, i + len(ks))))

                async def get() -> None:
                    for i in range(0, n, CALL_PAGES):
                        ks = self.keys[i : i + CALL_PAGES]
                        got = await rt.load(ks, self.out, list(range(i, i + len(ks))))
                        assert got == len(ks)

                t["put"].append(await timed(put))
                t["get"].append(await timed(get))
            assert (self.out == self.pages).all()
        return {k: n / med(v) for k, v in t.items()}  # pages/s

    # -- the 64-page prefix --------------------------------------------------------------
    async def prefix(self) -> dict[str, float]:
        r = self.r
        await r.flushdb()
        keys, raw = self.keys[:PREFIX], self.raw[:PREFIX]
        await r.mset(dict(zip(raw, self.values)))
        conns = [Redis.from_url(self.url) for _ in range(4)]

        async def mget_one() -> None:
            assert len(await r.mget(raw)) == PREFIX

        async def mget_pipe() -> None:
            pipe = r.pipeline(transaction=False)
            for i in range(0, PREFIX, 16):
                pipe.mget(raw[i : i + 16])
            await pipe.execute()

        async def mget_gather() -> None:
            await asyncio.gather(*(c.mget(raw[i * 16 : i * 16 + 16]) for i, c in enumerate(conns)))

        t: dict[str, list[float]] = {"mget": [], "mget_pipe16": [], "mget_4x16": [], "tier": []}
        async with RedisTier(self.url, spec=self.spec, timeout=30) as rt:
            await rt.publish(keys, self.pages, list(range(PREFIX)))
            slots = list(range(PREFIX))

            async def tier() -> None:
                assert await rt.load(keys, self.out, slots) == PREFIX

            for f in (mget_one, mget_pipe, mget_gather, tier):  # warm every connection
                await f()
            for _ in range(self.rounds * 5):
                t["mget"].append(await timed(mget_one))
                t["mget_pipe16"].append(await timed(mget_pipe))
                t["mget_4x16"].append(await timed(mget_gather))
                t["tier"].append(await timed(tier))
        for c in conns:
            await c.aclose()
        return {k: med(v) for k, v in t.items()}  # seconds

    # -- value layout --------------------------------------------------------------------
    async def layout(self) -> dict[str, dict[str, float]]:
        r, pb = self.r, self.spec.page_bytes
        blob = self.pages[:PREFIX].tobytes()
        out: dict[str, dict[str, float]] = {}
        for per in (1, 4, 16):
            vals = [blob[i * per * pb : (i + 1) * per * pb] for i in range(PREFIX // per)]
            names = [f"pack{per}:{i}".encode() for i in range(len(vals))]
            put, get = [], []
            for _ in range(self.rounds * 3):
                await r.delete(*names)

                async def set_all(vals: list[bytes] = vals, names: list[bytes] = names) -> None:
                    pipe = r.pipeline(transaction=False)
                    for k, v in zip(names, vals):
                        pipe.set(k, v)
                    await pipe.execute()

                async def get_all(names: list[bytes] = names) -> None:
                    assert sum(len(v) for v in await r.mget(names)) == len(blob)

                put.append(await timed(set_all))
                get.append(await timed(get_all))
            out[f"{per} page/value"] = {"set_s": med(put), "get_s": med(get)}
        return out

    # -- batch_pages ---------------------------------------------------------------------
    async def batch_sweep(self) -> dict[str, dict[str, float]]:
        """(batch_pages, in_flight) configurations, interleaved within each round."""
        n = self.n
        confs = [(16, 4), (32, 1), (32, 4), (64, 1), (64, 2), (64, 4), (128, 1), (n, 1)]
        tiers = {}
        for b, f in confs:
            rt = await RedisTier(self.url, spec=self.spec, timeout=30, batch_pages=b).connect()
            rt.in_flight = f
            tiers[f"{b}/{f}"] = rt
        names = ("load64", f"load{n}", f"publish{n}")
        fig: dict[str, dict[str, list[float]]] = {c: {k: [] for k in names} for c in tiers}
        every, first = list(range(n)), list(range(PREFIX))
        for _ in range(self.rounds):
            for conf, rt in tiers.items():
                await self.r.flushdb()
                f = fig[conf]
                f[names[2]].append(await timed(partial(rt.publish, self.keys, self.pages, every)))
                f[names[1]].append(await timed(partial(rt.load, self.keys, self.out, every)))
                for _ in range(3):
                    f[names[0]].append(
                        await timed(partial(rt.load, self.keys[:PREFIX], self.out, first))
                    )
        for rt in tiers.values():
            await rt.aclose()
        return {c: {k: med(v) for k, v in f.items()} for c, f in fig.items()}


def plot(path: str, sweeps: dict[str, dict[str, dict[str, float]]]) -> None:
    """Load / publish times per (batch_pages, in_flight), one panel per page size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.5))
    for ax, (name, sweep) in zip(np.atleast_1d(axes), sweeps.items()):
        confs = list(sweep)
        x = np.arange(len(confs))
        names = list(next(iter(sweep.values())))
        for i, fig_name in enumerate(names):
            ys = [sweep[c][fig_name] * 1e3 for c in confs]
            ax.bar(x + i / (len(names) + 1), ys, 1 / (len(names) + 1), label=fig_name)
        ax.set_xticks(x + 0.33, confs)
        ax.set_yscale("log")
        ax.set_xlabel("batch_pages / in_flight")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"RedisTier, {name} pages")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


async def main(quick: bool, json_path: str | None, plot_path: str | None) -> None:
    rounds = 3 if quick else 5
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    sweeps: dict[str, dict[str, dict[str, float]]] = {}
    # a cache server, as docs/redis.md recommends (and RedisTier warns without): no maxmemory
    # is set, so nothing is evicted during the run
    with RedisServer(args=["--maxmemory-policy", "allkeys-lru"]) as srv:
        print(f"redis-server on {srv.url}; loop {type(asyncio.get_running_loop()).__module__}")
        for name, spec in SPECS.items():
            n = (256 if quick else 1024) if spec.page_bytes < 32768 else (256 if quick else 512)
            b = Bench(srv.url, spec, n, rounds)
            print(f"\n== {name} pages ({spec.page_bytes} B), {n} pages ==", flush=True)
            with phase(f"{name} throughput"):
                tp = await b.throughput()
            rows = []
            for op in ("put", "get"):
                mbs = tp[op] * spec.page_bytes / 1e6
                rows.append([op, tp[f"naive_{op}"], tp[op], mbs, tp[op] / tp[f"naive_{op}"]])
            head = ["op", "per-page pages/s", "RedisTier pages/s", "MB/s", "ratio (>= 1.5)"]
            print(table(head, rows), flush=True)
            with phase(f"{name} prefix"):
                px = await b.prefix()
            best = min(("mget", "mget_pipe16", "mget_4x16"), key=px.__getitem__)
            print(
                table(
                    ["64-page prefix load", "ms"],
                    [[k, v * 1e3] for k, v in px.items()]
                    + [[f"ratio tier / best ({best}), <= 1.5", px["tier"] / px[best]]],
                ),
                flush=True,
            )
            with phase(f"{name} layout"):
                lay = await b.layout()
            print(
                table(
                    ["64 pages as", "pipelined SET ms", "MGET ms"],
                    [[k, v["set_s"] * 1e3, v["get_s"] * 1e3] for k, v in lay.items()],
                ),
                flush=True,
            )
            with phase(f"{name} batch sweep"):
                sweep = await b.batch_sweep()
            cols = list(next(iter(sweep.values())))
            print(
                table(
                    ["batch_pages/in_flight", *(f"{c} ms" for c in cols)],
                    [[bp, *(v[c] * 1e3 for c in cols)] for bp, v in sweep.items()],
                ),
                flush=True,
            )
            await b.aclose()
            sweeps[name] = sweep
            figures[name] = {"throughput_pages_s": tp, "prefix_s": px, "layout": lay,
                             "batch_pages": sweep}  # fmt: skip
            ratios[name] = {
                "put_vs_per_page": tp["put"] / tp["naive_put"],
                "get_vs_per_page": tp["get"] / tp["naive_get"],
                "prefix64_vs_best_mget": px["tier"] / px[best],
            }
    print("\nratios:", ratios)
    write_json(json_path, figures, ratios)
    if plot_path:
        plot(plot_path, sweeps)


if __name__ == "__main__":
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--plot", metavar="FILE.png", help="draw the batch_pages sweep (matplotlib)")
    args = p.parse_args()
    start_trace(args.trace)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(args.quick, args.json, args.plot))
    else:
        uvloop.run(main(args.quick, args.json, args.plot))
    write_trace(args.trace)
