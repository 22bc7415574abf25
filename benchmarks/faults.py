"""Page checksums under injected faults, and what they cost (issue 23).

    python benchmarks/faults.py [--quick] [--json FILE] [--faults N]

Faults, each a page whose bytes change at one boundary (1 to 8 random bits flipped, or a random
byte run overwritten), every one of which must be counted and none served:

  server slots   pages flipped in a page server's host tier after publish; a RemoteTier reader
                 loads all of them (tcp and shm): the pages it returns must be bit-exact, and
                 its ``corrupt`` count must grow by the number flipped
  wire           the reader's copy flipped after the transport delivered it (after the tcp
                 frame check): the same checks
  commit         a writer's pages changed after their checksums were taken: the server stores
                 the others only (CorruptPageError names the count), the stored ones exact
  redis          values flipped in Redis (the value checksum), and pages wrong at the publisher
                 (a well-formed value whose page CRC-32C differs): misses, counted, deleted
  cold           encoded cold payloads flipped: the lease fails with CorruptPageError, counted

Cost (``TIERKV_PAGE_CHECKSUMS=0`` against on, rounds interleaved, medians): RemoteTier.load and
publish of 64 pages of 256 KB over tcp and shm, in this process (publish declares the pages'
checksums, as a store's pushes do from its page table: the server's check is the cost).
benchmarks/transports.py measures the transports themselves, which page checksums leave as
they were.
Nothing here asserts on time; a wrong page served or a fault not counted fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))

import torch

from benchmarks._common import parser, table, write_json
from tierkv import CorruptPageError, KVSpec, KVStore, prefix_keys
from tierkv.keys import page_key
from tierkv.page_sums import row_sums
from tierkv.remote import PageServer, RemoteTier
from tierkv.remote.store_io import stage_prefix
from tierkv.tiers import COLD, DEVICE, HOST
from tierkv.transports.tcp import TcpTransport

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)  # 1 KB
SECRET = b"faults-bench"
TIMEOUT = 10.0
Pages = np.ndarray[Any, np.dtype[np.uint8]]


class Tally:
    """Faults injected, counted by the code under test, and wrong pages served."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}

    def add(self, what: str, injected: int, counted: int, wrong: int) -> None:
        row = self.rows.setdefault(what, [0, 0, 0])
        row[0] += injected
        row[1] += counted
        row[2] += wrong


def content_keys(seed: int, n: int) -> list[bytes]:
    toks = np.random.default_rng(seed).integers(0, 1 << 20, n // 2 * 4).tolist()
    return [page_key(b, layer) for b in prefix_keys(toks, 4) for layer in range(2)]


def corrupt_row(row: Pages, rng: np.random.Generator) -> None:
    """Change ``row`` in place: 1-8 random bits (distinct), or a random run of 1-64 bytes
    (always some change: a fault that changes nothing is not one)."""
    if rng.random() < 0.75:
        bits = rng.choice(row.size * 8, int(rng.integers(1, 9)), replace=False)
        for b in bits.tolist():
            row[b >> 3] ^= np.uint8(1 << (b & 7))
        return
    n = int(rng.integers(1, 65))
    at = int(rng.integers(0, row.size - n))
    old = row[at : at + n].copy()
    row[at : at + n] = rng.integers(0, 256, n, np.uint8)
    if np.array_equal(old, row[at : at + n]):
        row[at] ^= np.uint8(1)


@contextlib.asynccontextmanager
async def server(kind: str, pages: int) -> AsyncIterator[PageServer]:
    page = SPEC.page_bytes
    store = KVStore(SPEC, device_bytes=page, host_bytes=pages * page, codec=None)
    async with store, PageServer(store, transports=[kind], secret=SECRET) as srv:
        yield srv


def peer(srv: PageServer, kind: str, cls: type[RemoteTier] = RemoteTier) -> RemoteTier:
    return cls(srv.address, transport=kind, secret=SECRET, spec=SPEC, timeout=TIMEOUT)


# -- faults -----------------------------------------------------------------------------------
async def server_slots(kind: str, faults: int, tally: Tally, n: int = 256, per: int = 32) -> None:
    rng = np.random.default_rng(1)
    keys = content_keys(1, n)
    data = rng.integers(0, 256, (n, SPEC.page_bytes), np.uint8)
    out = np.zeros_like(data)
    async with server(kind, n) as srv, peer(srv, kind) as w, peer(srv, kind) as r:
        assert await w.publish(keys, data, list(range(n))) == n
        host, tbl = srv.store.tiers.glue.host_array, srv.store.tiers.table
        slots = [tbl.slot(k, HOST) for k in keys]
        done = 0
        while done < faults:
            bad = rng.choice(n, min(per, faults - done), replace=False)
            for i in bad:
                corrupt_row(host[slots[i]], rng)
            before = r.corrupt
            got = await r.load(keys, out, list(range(n)))
            wrong = int((out[:got] != data[:got]).any(axis=1).sum())
            tally.add(f"server slots ({kind})", len(bad), r.corrupt - before, wrong)
            host[[slots[i] for i in bad]] = data[bad]  # repaired for the next round
            done += len(bad)


@contextlib.contextmanager
def tampered_reads(per: int, hit: list[int]) -> Iterator[None]:
    """Reads through the tcp transport whose pages change after every frame passed its CRC
    check (``per`` ops of each read; ``hit`` gets how many)."""
    real = TcpTransport._transfer
    rng = np.random.default_rng(2)

    async def tampered(self: TcpTransport, direction: Any, ops: Any, *args: Any) -> None:
        await real(self, direction, ops, *args)
        if direction == "read":
            for i in rng.choice(len(ops), min(per, len(ops)), replace=False).tolist():
                op = ops[i]
                view = np.frombuffer(op.local.view, np.uint8)
                corrupt_row(view[op.local_offset : op.local_offset + op.length], rng)
            hit[0] = min(per, len(ops))

    TcpTransport._transfer = tampered  # type: ignore[method-assign]
    try:
        yield
    finally:
        TcpTransport._transfer = real  # type: ignore[method-assign]


async def wire(faults: int, tally: Tally, n: int = 256, per: int = 16) -> None:
    rng = np.random.default_rng(3)
    keys = content_keys(3, n)
    data = rng.integers(0, 256, (n, SPEC.page_bytes), np.uint8)
    out = np.zeros_like(data)
    hit = [0]
    async with server("tcp", n) as srv, peer(srv, "tcp") as w, peer(srv, "tcp") as r:
        assert await w.publish(keys, data, list(range(n))) == n
        done = 0
        with tampered_reads(per, hit):
            while done < faults:
                before = r.corrupt
                got = await r.load(keys, out, list(range(n)))
                wrong = int((out[:got] != data[:got]).any(axis=1).sum())
                tally.add("wire, after the frame check (tcp)", hit[0], r.corrupt - before, wrong)
                done += hit[0]


async def commit(faults: int, tally: Tally, n: int = 128, per: int = 16) -> None:
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (n, SPEC.page_bytes), np.uint8)
    sums = row_sums(data, list(range(n)))
    async with server("tcp", 2 * n) as srv, peer(srv, "tcp") as w:
        tiers = srv.store.tiers
        done, seed = 0, 10
        while done < faults:
            keys = content_keys(seed, n)
            seed += 1
            bad = rng.choice(n, min(per, faults - done), replace=False)
            sent = data.copy()
            for i in bad:
                corrupt_row(sent[i], rng)
            counted = 0
            try:
                await w.publish(keys, sent, list(range(n)), sums=sums)
            except CorruptPageError as exc:
                counted = exc.pages
            held = tiers.table.readable(keys, HOST)
            where = dict(zip(keys, range(n)))
            stored = [tiers.table.slot(k, HOST) for k in held]
            wrong = sum(
                1
                for k, s in zip(held, stored)
                if not np.array_equal(tiers.glue.host_array[s], data[where[k]])
            )
            tally.add("commit (writer's bytes)", len(bad), counted, wrong)
            tiers.cold.forget_in(HOST, held)
            done += len(bad)


async def redis(faults: int, tally: Tally, n: int = 128, per: int = 16) -> None:
    import redis as redis_client
    from _redis_server import PrivateRedis, RedisStartError

    from tierkv.remote import RedisTier

    rng = np.random.default_rng(5)
    keys = content_keys(5, n)
    data = rng.integers(0, 256, (n, SPEC.page_bytes), np.uint8)
    sums = row_sums(data, list(range(n)))
    out = np.zeros_like(data)
    try:
        ctx = PrivateRedis()
        url = ctx.__enter__()
    except RedisStartError as exc:
        print(f"redis: skipped ({exc})")
        return
    try:
        async with RedisTier(url, spec=SPEC, namespace="faults", timeout=TIMEOUT) as rt:
            raw = redis_client.Redis.from_url(url)
            done, flip = 0, False
            while done < faults:
                bad = sorted(rng.choice(n, min(per, faults - done), replace=False).tolist())
                if flip:  # the value in Redis changed
                    assert await rt.publish(keys, data, list(range(n)), sums=sums) >= 0
                    for i in bad:
                        rk = rt.redis_key(keys[i])
                        value = np.frombuffer(raw.get(rk), np.uint8).copy()
                        corrupt_row(value, rng)
                        raw.set(rk, value.tobytes())
                    what = "redis values"
                else:  # the page was wrong at the publisher: a well-formed value
                    raw.delete(*[rt.redis_key(keys[i]) for i in bad])
                    sent = data.copy()
                    for i in bad:
                        corrupt_row(sent[i], rng)
                    await rt.publish([keys[i] for i in bad], sent, bad, sums=[sums[i] for i in bad])
                    what = "redis, wrong at the publisher"
                before = rt.stats()["corrupt"]
                got = await rt.load(keys, out, list(range(n)))
                # every value of the batch is read (the chunks run ahead): count them all
                for i in range(got, n):
                    await rt.load([keys[i]], out, [i])
                counted = int(rt.stats()["corrupt"] - before)
                wrong = int((out[:got] != data[:got]).any(axis=1).sum())
                tally.add(what, len(bad), counted, wrong)
                await rt.publish(keys, data, list(range(n)), sums=sums)  # repaired
                done += len(bad)
                flip = not flip
            raw.close()
    finally:
        ctx.__exit__(None, None, None)


async def cold(faults: int, tally: Tally) -> None:
    rng = np.random.default_rng(6)
    page = SPEC.page_bytes
    store = KVStore(
        SPEC,
        device_bytes=16 * page,
        host_bytes=24 * page,
        codec="int8",
        cold_fraction=0.5,
        timeout=TIMEOUT,
    )
    async with store:
        tiers = store.tiers
        g = torch.Generator().manual_seed(6)
        done, seed = 0, 0
        while done < faults:
            prompt = [seed * 100 + i for i in range(9)]  # 2 full blocks: 4 content pages
            seed += 1
            await store.add_sequence("s", prompt)
            async with store.lease(["s"]) as lease:
                for layer in range(2):
                    k = torch.randn((2, 9, 16), generator=g)
                    await lease.append("s", layer, k, k.clone())
            await store.release("s")
            await stage_prefix(store, prompt)
            keys = [page_key(b, lay) for b in prefix_keys(prompt[:8], 4) for lay in range(2)]
            tiers.cold.forget_in(DEVICE, keys)
            if await tiers.cold.compress_idle(keys) != 4:
                continue
            i = int(rng.integers(0, 4))
            corrupt_row(tiers._arenas[COLD].array[tiers.table.slot(keys[i], COLD)], rng)
            before = store.stats()["corrupt_pages"]["cold"]
            served = 0
            await store.add_sequence("t", prompt)
            try:
                async with store.lease(["t"]):
                    served = 1  # must never happen
            except CorruptPageError:
                pass
            await store.release("t")
            counted = store.stats()["corrupt_pages"]["cold"] - before
            tally.add("cold payloads (int8)", 1, counted, served)
            for t in (DEVICE, HOST, COLD):
                tiers.cold.forget_in(t, keys)
            done += 1


# -- cost -------------------------------------------------------------------------------------
async def cost(kind: str, rounds: int) -> dict[str, float]:
    """Medians of RemoteTier.load / publish of 64 x 256 KB pages, checksums on and off."""
    spec = KVSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=64)
    n, pb = 64, spec.page_bytes
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (n, pb), np.uint8)
    sums = row_sums(data, list(range(n)))  # as a store's page table holds them
    out = np.zeros_like(data)
    store = KVStore(spec, device_bytes=pb, host_bytes=4 * n * pb, codec=None)
    times: dict[str, list[float]] = {"load on": [], "load off": [], "pub on": [], "pub off": []}
    async with store, PageServer(store, transports=[kind], secret=SECRET) as srv:
        kw = {"transport": kind, "secret": SECRET, "spec": spec, "timeout": 30.0}
        async with RemoteTier(srv.address, **kw) as w, RemoteTier(srv.address, **kw) as r:
            for i in range(rounds):
                for mode in ("on", "off") if i % 2 else ("off", "on"):
                    os.environ["TIERKV_PAGE_CHECKSUMS"] = "1" if mode == "on" else "0"
                    keys = content_keys(1000 + 2 * i + (mode == "on"), n)
                    t0 = time.perf_counter()
                    await w.publish(keys, data, list(range(n)), sums=sums)
                    t1 = time.perf_counter()
                    got = await r.load(keys, out, list(range(n)))
                    t2 = time.perf_counter()
                    assert got == n and np.array_equal(out, data)
                    times[f"pub {mode}"].append(t1 - t0)
                    times[f"load {mode}"].append(t2 - t1)
                    store.tiers.cold.forget_in(HOST, keys)
            os.environ.pop("TIERKV_PAGE_CHECKSUMS", None)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = n * pb / 1e9
    return {
        "load GB/s on": gb / med["load on"],
        "load GB/s off": gb / med["load off"],
        "load on / off": med["load off"] / med["load on"],
        "publish GB/s on": gb / med["pub on"],
        "publish GB/s off": gb / med["pub off"],
        "publish on / off": med["pub off"] / med["pub on"],
    }


async def append_cost(rounds: int, steps: int = 64, seqs: int = 64) -> dict[str, float]:
    """Decode steps (one lease over ``seqs`` sequences, one token appended per layer) with page
    checksums on and off, rounds interleaved: the loop thread's CPU seconds per round (what
    other processes on the machine take is not counted), medians."""
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    pb = spec.page_bytes  # 64 KB
    need = 2 * seqs * spec.num_layers * -(-(16 + steps) // 16)
    store = KVStore(spec, device_bytes=need * pb, host_bytes=need * pb, codec=None)
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    k = torch.randn((8, 1, 128), dtype=torch.float16)
    sealing = [0.0, 0.0]  # CPU seconds inside TierSet.seal, pages sealed (checksums on)
    counting = [False]  # in a measured round with checksums on
    async with store:
        real = store.tiers.pages.seal

        def timed(keys: Any) -> None:
            t0 = time.thread_time()
            real(keys)
            if counting[0]:
                sealing[0] += time.thread_time() - t0
                sealing[1] += len(keys)

        store.tiers.pages.seal = timed  # type: ignore[method-assign]
        ids = [f"s{i}" for i in range(seqs)]
        for r in range(2 * rounds + 2):
            mode = ("on", "off")[(r + r // 2) % 2]  # on off off on on off ...
            os.environ["TIERKV_PAGE_CHECKSUMS"] = "1" if mode == "on" else "0"
            for i, sid in enumerate(ids):  # fresh sequences: each round the same work
                await store.add_sequence(sid, [(r * seqs + i) * 1000 + t for t in range(16)])
            counting[0] = mode == "on" and r >= 2
            c0 = time.thread_time()
            for _ in range(steps):
                for sid in ids:
                    store.add_tokens(sid, [7])
                async with store.lease(ids) as lease:
                    for sid in ids:
                        for layer in range(spec.num_layers):
                            await lease.append(sid, layer, k, k)
                store.step()
            if r >= 2:  # the first pair warms up
                cpu[mode].append(time.thread_time() - c0)
            for sid in ids:
                await store.release(sid)
            for t in (DEVICE, HOST):  # nothing cached: the next round starts alike
                store.tiers.cold.forget_in(t, store.tiers.table.keys(t))
        os.environ.pop("TIERKV_PAGE_CHECKSUMS", None)
    on, off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    return {
        "cpu s on": on,
        "cpu s off": off,
        "on / off": off / on,
        "seal share of on rounds": sealing[0] / sum(cpu["on"]),
        "seal us per page": sealing[0] / max(1.0, sealing[1]) * 1e6,
    }


async def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=0, help="total faults (default 100,000)")
    args = p.parse_args()
    total = args.faults or (10_000 if args.quick else 100_000)
    share: list[tuple[float, Callable[[int, Tally], Any]]] = [
        (0.30, lambda f, t: server_slots("tcp", f, t)),
        (0.30, lambda f, t: server_slots("shm", f, t)),
        (0.20, wire),
        (0.08, commit),
        (0.08, redis),
        (0.04, cold),
    ]
    tally = Tally()
    t0 = time.perf_counter()
    for frac, run in share:
        await run(max(1, int(total * frac)), tally)
    took = time.perf_counter() - t0
    rows, injected, counted, wrong = [], 0, 0, 0
    for what, (i, c, w) in tally.rows.items():
        rows.append([what, f"{i:,}", f"{c:,}", f"{w:,}"])
        injected, counted, wrong = injected + i, counted + c, wrong + w
    rows.append(["total", f"{injected:,}", f"{counted:,}", f"{wrong:,}"])
    print(table(["boundary", "faults injected", "counted corrupt", "wrong served"], rows))
    print(f"({took:.1f} s)")
    figures: dict[str, Any] = {"faults": tally.rows, "seconds": took}
    ratios: dict[str, float] = {}
    crows = []
    for kind in ("tcp", "shm"):
        c = await cost(kind, 5 if args.quick else 15)
        figures[f"cost {kind}"] = c
        for op in ("load", "publish"):
            r = c[f"{op} on / off"]
            ratios[f"{kind} {op}: checksums on / off"] = r
            on, off = c[f"{op} GB/s on"], c[f"{op} GB/s off"]
            crows.append([f"{kind} {op}", f"{on:.2f}", f"{off:.2f}", f"{r:.3f}"])
    print(table(["RemoteTier, 64 x 256 KB", "GB/s on", "GB/s off", "on / off"], crows))
    a = await append_cost(4 if args.quick else 10)
    figures["append cost"] = a
    ratios["decode steps (append path), CPU s: checksums on / off"] = a["on / off"]
    ratios["decode steps: 1 - share of CPU in seal"] = 1 - a["seal share of on rounds"]
    head = ["decode steps: 64 seqs x 4 layers, 64 KB pages", "CPU s on", "CPU s off", "on / off"]
    row = ["median round", f"{a['cpu s on']:.3f}", f"{a['cpu s off']:.3f}", f"{a['on / off']:.3f}"]
    print(table(head, [row]))
    print(
        f"seal: {a['seal us per page']:.1f} us per page sealed, "
        f"{100 * a['seal share of on rounds']:.2f}% of the CPU of the rounds with checksums on"
    )
    write_json(args.json, figures, ratios)
    if wrong or counted != injected:
        raise SystemExit(f"FAILED: {wrong} wrong pages served, {injected - counted} not counted")


if __name__ == "__main__":
    asyncio.run(main())
