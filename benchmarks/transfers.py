"""Page moves through the transfer engine against a single-thread copy, measured in one run.

    python benchmarks/transfers.py [--quick] [--json FILE] [--plot FILE.png]

References (single thread, one large contiguous copy, best of the rounds):
  copy_256mb  numpy copyto of 256 MB: the limit issue 3 names. Note: glibc switches memcpy to
              non-temporal stores above `x86_non_temporal_threshold` (3/4 of the L3 size it
              reads; 192 MB on a VM that reports a 256 MB L3), so this copy can run up to ~1.6x
              faster than any copy below that size.
  copy_64mb   numpy copyto of 64 MB: the same copy in the store mode page-sized copies get.
Engine: random, non-adjacent slot ids on both sides, batches of --batch pages, `max_inflight`
batches in flight, awaited through asyncio (uvloop when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import Arena, CpuBackend, Priority, TransferEngine, run
from runtime.arena import allocate_host_buffer

MB = 1 << 20
KB = 1 << 10


def copy_bandwidth(nbytes: int, rounds: int) -> float:
    """Best single-thread np.copyto bandwidth (bytes/s) for one contiguous copy of `nbytes`."""
    a = allocate_host_buffer(nbytes)
    b = allocate_host_buffer(nbytes)
    a[:] = 1
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def scattered_ids(num_slots: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` distinct slot ids with no two adjacent (so no run can be coalesced)."""
    ids = rng.choice(num_slots // 2, size=n, replace=False) * 2
    return rng.permutation(ids).astype(np.int64)


async def engine_bandwidth(
    engine: TransferEngine, src: Arena, dst: Arena, batch: int, batches: int, seed: int
) -> float:
    """Bytes/s of `batches` batches of `batch` scattered pages, `max_inflight` at a time."""
    rng = np.random.default_rng(seed)
    plan = [
        (scattered_ids(src.num_slots, batch, rng), scattered_ids(dst.num_slots, batch, rng))
        for _ in range(batches)
    ]
    sem = asyncio.Semaphore(engine.max_inflight)

    async def one(s: np.ndarray, d: np.ndarray) -> None:
        async with sem:
            await engine.submit(src, s, dst, d, priority=Priority.PREFETCH)

    t = time.perf_counter()
    await asyncio.gather(*(one(s, d) for s, d in plan))
    return batch * batches * src.slot_bytes / (time.perf_counter() - t)


async def measure_pages(
    page: int, arena_bytes: int, batch: int, moved_bytes: int, rounds: int, max_inflight: int
) -> dict[str, float]:
    backend = CpuBackend()
    n = arena_bytes // page
    src = backend.create_arena("src", page, n)
    dst = backend.create_arena("dst", page, n)
    src.allocate(n)
    dst.allocate(n)
    src.array[:] = 3
    batches = max(1, moved_bytes // (batch * page))
    best = 0.0
    async with TransferEngine(backend, max_inflight=max_inflight) as engine:
        await engine_bandwidth(engine, src, dst, batch, 2, seed=99)  # warm up
        for r in range(rounds):
            bw = await engine_bandwidth(engine, src, dst, batch, batches, seed=r)
            best = max(best, bw)
            print(f"  {page // KB:>4} KB pages  round {r + 1}/{rounds}: {bw / 1e9:6.2f} GB/s")
        stats = engine.stats
    backend.close()
    return {
        "bandwidth_gbps": best / 1e9,
        "mean_copy_gbps": stats.bandwidth_gbps,
        "batch_pages": batch,
        "mean_queue_wait_ms": 1e3 * stats.queue_wait_s / max(1, stats.completed),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller arenas and fewer rounds")
    p.add_argument("--json", type=Path, help="write {figures, ratios} to this file")
    p.add_argument("--plot", type=Path, help="draw a bar chart (PNG; needs matplotlib)")
    p.add_argument("--max-inflight", type=int, default=4)
    args = p.parse_args(argv)

    rounds = 3 if args.quick else 5
    arena = 256 * MB if args.quick else 1024 * MB
    moved = 256 * MB if args.quick else 512 * MB
    print("reference: single-thread contiguous copies ...")
    ref_big = copy_bandwidth(256 * MB, rounds + 2)
    ref_small = copy_bandwidth(64 * MB, rounds + 2)
    print(f"  copy 256 MB: {ref_big / 1e9:.2f} GB/s   copy 64 MB: {ref_small / 1e9:.2f} GB/s")
    figures: dict[str, object] = {
        "copy_256mb_gbps": ref_big / 1e9,
        "copy_64mb_gbps": ref_small / 1e9,
        "max_inflight": args.max_inflight,
        "arena_mb": arena // MB,
    }
    ratios: dict[str, float] = {}
    targets = {256 * KB: 0.9, 16 * KB: 0.7}
    rows = []
    for page, batch in ((256 * KB, 64), (16 * KB, 256)):
        print(f"engine: {page // KB} KB pages, batches of {batch} ...")
        fig = run(measure_pages(page, arena, batch, moved, rounds, args.max_inflight))
        key = f"pages_{page // KB}kb"
        figures[key] = fig
        bw = fig["bandwidth_gbps"] * 1e9
        ratios[f"{key}_vs_copy_256mb"] = bw / ref_big
        ratios[f"{key}_vs_copy_64mb"] = bw / ref_small
        rows.append((page, bw, targets[page]))
    ref_row = f"{'copy 256 MB':<16}{ref_big / 1e9:>8.2f}"
    print()
    print(f"{'':<16}{'GB/s':>8}{'/256MB':>9}{'/64MB':>8}{'target':>8}")
    print(ref_row)
    print(f"{'copy 64 MB':<16}{ref_small / 1e9:>8.2f}")
    for page, bw, target in rows:
        name = f"engine {page // KB} KB"
        print(f"{name:<16}{bw / 1e9:>8.2f}{bw / ref_big:>9.2f}{bw / ref_small:>8.2f}{target:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "ratios": ratios}, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = ["copy 256 MB", "copy 64 MB"] + [f"engine {p // KB} KB" for p, _, _ in rows]
        values = [ref_big / 1e9, ref_small / 1e9] + [bw / 1e9 for _, bw, _ in rows]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(names, values)
        ax.set_ylabel("GB/s")
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
