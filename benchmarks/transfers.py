"""Page moves through the transfer engine against a single-thread copy, measured in one run.

    python benchmarks/transfers.py [--quick] [--json FILE] [--plot FILE.png] [--trace FILE.json]

The limits the engine chases (the ratios that count):
  copy        one single-thread np.copyto of the bytes of one batch (e.g. 128 x 256 KB = 32 MB),
              contiguous, between the engine's own two arenas at random offsets, so it sees the
              same sizes and cache state (glibc switches memcpy to non-temporal stores only above
              `x86_non_temporal_threshold`, 3/4 of the L3 it reads). Each round copies as many
              batches' worth as the engine round moves.
  gather      torch.index_select of the very pages the engine round moves (its source ids) into
              a contiguous stretch of the destination arena: the gather limit of this machine.
              Measured at one thread and at torch's default thread count; the limit is the faster.
              After a multi-thread gather the run pauses (untimed) until torch's OpenMP workers
              stop spinning: they spin ~10 ms after a parallel region, and on a 2-core machine
              that took a core from the engine round measured next (rounds bimodal, 7 vs 12 GB/s).
Engine: random, non-adjacent slot ids on both sides, batches of --batch-256kb / --batch-16kb pages,
`max_inflight` batches in flight, each awaited through asyncio (uvloop when installed).
Rounds alternate copy, gather and engine so that load from other processes hits all alike; the
table shows medians over the rounds, ratios = median engine / median limit. The load average
before and after the run is printed and written to the JSON.
For information only: copy_256mb, one 256 MB np.copyto (non-temporal stores on most machines).
--trace: the engine's timeline (each batch's copy on its stream's track, with its queue wait and
kernel) and the reference and engine rounds as phases, in one Chrome trace (Perfetto).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import add_trace_flag, phase, start_trace, table, write_json, write_trace
from tierkv.runtime import Arena, CpuBackend, Priority, TransferEngine, run
from tierkv.runtime.arena import allocate_host_buffer
from tierkv.runtime.cpu_copy import STREAM_MIN_BYTES, native_streaming
from tierkv.timeline import Timeline

MB = 1 << 20
KB = 1 << 10
# (vs a same-size copy, vs the gather limit); None: no target (printed for information)
TARGETS: dict[int, tuple[float, float | None]] = {256 * KB: (0.9, None), 16 * KB: (0.7, 0.9)}
Plan = list[tuple[np.ndarray, np.ndarray]]
# Pause after a multi-thread gather (outside any timing) until torch's OpenMP workers stop spinning.
OMP_SETTLE_S = 0.05


def copy_256mb(reps: int) -> float:
    """Median single-thread np.copyto bandwidth (bytes/s) of one 256 MB copy (information)."""
    a = allocate_host_buffer(256 * MB)
    b = allocate_host_buffer(256 * MB)
    a[:] = 1
    b[:] = 0  # commit the lazily mapped pages before timing
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 256 * MB / statistics.median(times)


def reference_round(src: Arena, dst: Arena, nbytes: int, count: int, seed: int) -> float:
    """Bytes/s of `count` contiguous single-thread copies of `nbytes`, arena to arena."""
    a, b = src.array.reshape(-1), dst.array.reshape(-1)
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, a.size // nbytes, size=(count, 2)) * nbytes
    t = time.perf_counter()
    for i, j in offs.tolist():
        np.copyto(b[j : j + nbytes], a[i : i + nbytes])
    return nbytes * count / (time.perf_counter() - t)


def gather_round(src: Arena, dst: Arena, plan: Plan, threads: int, seed: int) -> float:
    """Bytes/s of torch.index_select of each batch's source pages into a contiguous stretch of
    `dst` (at random offsets), on `threads` threads."""
    page = src.slot_bytes
    a = torch.from_numpy(src.array)
    b = torch.from_numpy(dst.array.reshape(-1))
    batch = plan[0][0].size
    rng = np.random.default_rng(seed)
    offs = (rng.integers(0, dst.num_slots // batch, size=len(plan)) * batch * page).tolist()
    index = [torch.from_numpy(s) for s, _ in plan]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = time.perf_counter()
        for ids, off in zip(index, offs):
            torch.index_select(a, 0, ids, out=b[off : off + batch * page].view(batch, page))
        elapsed = time.perf_counter() - t
    finally:
        torch.set_num_threads(before)
    if threads > 1:
        # torch's OpenMP workers spin after a parallel region (libgomp: up to ~10 ms here); on
        # two cores that spinning would take a core from whatever is measured next.
        time.sleep(OMP_SETTLE_S)
    return batch * len(plan) * page / elapsed


def scattered_ids(num_slots: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` distinct slot ids with no two adjacent (so no run can be coalesced)."""
    ids = rng.choice(num_slots // 2, size=n, replace=False) * 2
    return rng.permutation(ids).astype(np.int64)


def make_plan(src: Arena, dst: Arena, batch: int, batches: int, seed: int) -> Plan:
    """(source ids, destination ids) of `batches` batches of `batch` scattered pages."""
    rng = np.random.default_rng(seed)
    return [
        (scattered_ids(src.num_slots, batch, rng), scattered_ids(dst.num_slots, batch, rng))
        for _ in range(batches)
    ]


async def engine_round(
    engine: TransferEngine,
    src: Arena,
    dst: Arena,
    plan: Plan,
    timeline: Timeline | None = None,
) -> tuple[float, str]:
    """Bytes/s of the batches of `plan`, `max_inflight` at a time; each batch's copy goes to
    `timeline` (when recording) on the track of its stream."""
    batch = plan[0][0].size
    sem = asyncio.Semaphore(engine.max_inflight)
    kernels: set[str] = set()
    track = f"stream {src.name}->{dst.name}"

    async def one(s: np.ndarray, d: np.ndarray) -> None:
        async with sem:
            stats = await engine.submit(src, s, dst, d, priority=Priority.PREFETCH)
            kernels.add(stats.kernel)
            if timeline is not None:
                timeline.span(
                    "copy",
                    track,
                    stats.started_at,
                    stats.finished_at,
                    pages=stats.pages,
                    bytes=stats.bytes,
                    queue_wait_ms=stats.queue_wait_s * 1e3,
                    kernel=stats.kernel,
                )

    t = time.perf_counter()
    await asyncio.gather(*(one(s, d) for s, d in plan))
    elapsed = time.perf_counter() - t
    return batch * len(plan) * src.slot_bytes / elapsed, ",".join(sorted(kernels))


async def measure(
    page: int,
    batch: int,
    arena_bytes: int,
    moved_bytes: int,
    rounds: int,
    max_inflight: int,
    timeline: Timeline | None = None,
) -> dict[str, object]:
    """Interleaved rounds of reference copies, gathers of the same pages and engine page moves
    on the same two arenas (the engine's copies recorded in `timeline` when given)."""
    backend = CpuBackend()
    n = arena_bytes // page
    src = backend.create_arena("src", page, n)
    dst = backend.create_arena("dst", page, n)
    src.allocate(n)
    dst.allocate(n)
    src.array[:] = 3
    dst.array[:] = 0  # commit the lazily mapped pages before timing
    batches = max(1, moved_bytes // (batch * page))
    refs, engs = [], []
    threads = sorted({1, torch.get_num_threads()})
    gathers: dict[int, list[float]] = {t: [] for t in threads}
    async with TransferEngine(backend, max_inflight=max_inflight) as engine:
        warm = make_plan(src, dst, batch, 2, seed=99)
        _, kernel = await engine_round(engine, src, dst, warm)
        reference_round(src, dst, batch * page, 2, seed=99)
        for t in threads:
            gather_round(src, dst, warm, t, seed=99)
        size = f"{page // KB} KB x {batch}"
        for r in range(rounds):
            plan = make_plan(src, dst, batch, batches, seed=r)
            with phase(f"reference {size}", round=r):
                refs.append(reference_round(src, dst, batch * page, batches, seed=r))
            for t in threads:
                with phase(f"gather {size}, {t} threads", round=r):
                    gathers[t].append(gather_round(src, dst, plan, t, seed=r))
            with phase(f"engine {size}", round=r):
                bw, kernel = await engine_round(engine, src, dst, plan, timeline)
            engs.append(bw)
            gather_now = max(g[-1] for g in gathers.values())
            print(
                f"  {page // KB:>3} KB x {batch:<4} round {r + 1}/{rounds}: "
                f"copy {refs[-1] / 1e9:5.2f}  gather {gather_now / 1e9:5.2f}  "
                f"engine {bw / 1e9:5.2f} GB/s",
                flush=True,
            )
        stats = engine.stats
    backend.close()
    ref, eng = statistics.median(refs), statistics.median(engs)
    gather_by_threads = {t: statistics.median(g) for t, g in gathers.items()}
    gather_threads = max(gather_by_threads, key=lambda t: gather_by_threads[t])
    gather = gather_by_threads[gather_threads]
    return {
        "page_kb": page // KB,
        "batch_pages": batch,
        "batch_mb": batch * page / MB,
        "ref_gbps": ref / 1e9,
        "gather_gbps": gather / 1e9,
        "gather_threads": gather_threads,
        "gather_gbps_by_threads": {str(t): g / 1e9 for t, g in gather_by_threads.items()},
        "engine_gbps": eng / 1e9,
        "ratio": eng / ref,
        "ratio_vs_gather": eng / gather,
        "round_ratios": [e / r for e, r in zip(engs, refs)],
        "kernel": kernel,
        "mean_queue_wait_ms": 1e3 * stats.queue_wait_s / max(1, stats.completed),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller arenas and fewer rounds")
    p.add_argument("--json", help="write {figures, ratios, machine} to this file")
    p.add_argument("--plot", type=Path, help="draw a bar chart (PNG; needs matplotlib)")
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument("--rounds", type=int, help="rounds per page size (default 5, --quick 3)")
    p.add_argument("--batch-256kb", type=int, default=128, help="256 KB pages per batch")
    p.add_argument("--batch-16kb", type=int, default=2048, help="16 KB pages per batch")
    add_trace_flag(p)
    args = p.parse_args(argv)
    start_trace(args.trace)
    engine_timeline = Timeline(enabled=bool(args.trace))

    rounds = args.rounds or (3 if args.quick else 5)
    arena = 256 * MB if args.quick else 1024 * MB
    moved = 128 * MB if args.quick else 256 * MB
    print("copy 256 MB (information) ...", flush=True)
    with phase("copy 256 MB"):
        big = copy_256mb(rounds + 2)
    figures: dict[str, object] = {
        "copy_256mb_gbps": big / 1e9,
        "max_inflight": args.max_inflight,
        "arena_mb": arena // MB,
        "streaming": native_streaming(),
        "stream_min_bytes": STREAM_MIN_BYTES,
        "load_before": os.getloadavg(),
    }
    ratios: dict[str, float] = {}
    rows: list[list[object]] = [["copy 256 MB (info)", big / 1e9, "", "", "", "", ""]]
    for page, batch in ((256 * KB, args.batch_256kb), (16 * KB, args.batch_16kb)):
        print(f"{page // KB} KB pages, batches of {batch}, {arena // MB} MB arenas ...", flush=True)
        fig = run(measure(page, batch, arena, moved, rounds, args.max_inflight, engine_timeline))
        figures[f"pages_{page // KB}kb"] = fig
        ratio = float(fig["ratio"])  # type: ignore[arg-type]
        vs_gather = float(fig["ratio_vs_gather"])  # type: ignore[arg-type]
        ratios[f"pages_{page // KB}kb_vs_same_size_copy"] = ratio
        ratios[f"pages_{page // KB}kb_vs_gather"] = vs_gather
        ratios[f"pages_{page // KB}kb_vs_copy_256mb"] = float(fig["engine_gbps"]) * 1e9 / big  # type: ignore[arg-type]
        name = f"engine {page // KB} KB x {batch} ({fig['batch_mb']:g} MB)"
        want_copy, want_gather = TARGETS[page]
        met = ratio >= want_copy and (want_gather is None or vs_gather >= want_gather)
        rows.append([name, fig["engine_gbps"], fig["ref_gbps"], fig["gather_gbps"],
                     f"{ratio:.3f} (>= {want_copy})",
                     f"{vs_gather:.3f}" + (f" (>= {want_gather})" if want_gather else " (info)"),
                     "yes" if met else "NO"])  # fmt: skip
    figures["load_after"] = os.getloadavg()
    by_threads = ", ".join(
        f"{t}: {g:.2f}"
        for t, g in figures["pages_16kb"]["gather_gbps_by_threads"].items()  # type: ignore[index]
    )
    print()
    print(table(["", "GB/s", "copy GB/s", "gather GB/s", "vs copy", "vs gather", "met"], rows))
    print(
        f"(medians of {rounds} interleaved rounds; kernel {figures['pages_16kb']['kernel']}, "  # type: ignore[index]
        f"non-temporal stores {native_streaming() or 'none'} from {STREAM_MIN_BYTES // KB} KB "
        f"batches; gather: index_select at 16 KB, GB/s by threads {by_threads}; "
        f"load {figures['load_before'][0]:.2f} before, {figures['load_after'][0]:.2f} after)"  # type: ignore[index]
    )
    write_json(args.json, figures, ratios)
    write_trace(args.trace, ("transfer engine", engine_timeline))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels, eng, ref = [], [], []
        for page in (256, 16):
            f = figures[f"pages_{page}kb"]
            labels.append(f"{page} KB pages")
            eng.append(f["engine_gbps"])  # type: ignore[index]
            ref.append(f["ref_gbps"])  # type: ignore[index]
        x = np.arange(len(labels))
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(x - 0.2, ref, 0.4, label="single-thread copy, same size")
        ax.bar(x + 0.2, eng, 0.4, label="engine")
        ax.set_xticks(x, labels)
        ax.set_ylabel("GB/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
