"""The cuda backend on a GPU, in one run: its tests, copy bandwidths, event waiting, the demo.

    python benchmarks/gpu_check.py [--quick] [--json FILE] [--trace FILE.json]

1. `pytest -m cuda tests/runtime` (the orderings, IPC, pinning, DLPack tests).
2. References: one large cudaMemcpyAsync H2D and D2H, pinned and pageable.
3. Page moves through the engine (scattered slot ids, batches of ~16 MB, 4 in flight) for 16 KB,
   256 KB and 1 MB pages, against one cudaMemcpyAsync per page; ratio = batched / pinned large copy
   (targets: >= 0.85 at 256 KB, >= 0.6 at 16 KB).
4. Event waiting, both strategies: wake-up latency over a blocking synchronize of the same work,
   and the worst event-loop stall while 1,000 waits are in flight (target: no stall > 1 ms).
5. `tierkv demo --backend cuda` when the demo exists.
Without a GPU it says so, writes a JSON that says so, and exits 0.
--trace: each step as a span, and the cuda demo's own runtime timeline, in one Chrome trace.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# the repository first: benchmarks/transports.py must not shadow the transports package
sys.path.insert(0, str(ROOT))

from benchmarks._common import parser, phase, start_trace, table, write_json, write_trace  # noqa: E402
from tierkv.runtime.cuda_env import unavailable_reason  # noqa: E402

MB = 1 << 20
KB = 1 << 10


def step(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def run_tests() -> dict[str, Any]:
    step("pytest -m cuda tests/runtime ...")
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cuda",
            "tests/runtime",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else out.stderr.strip()[-200:]
    print(summary)
    if out.returncode != 0:
        print(out.stdout[-4000:])
    return {"rc": out.returncode, "summary": summary, "seconds": time.perf_counter() - t}


def timed_copy(cupy: Any, dst: int, src: int, nbytes: int, rounds: int) -> float:
    """Best bandwidth (B/s) of one cudaMemcpyAsync of `nbytes`, timed with CUDA events."""
    s = cupy.cuda.Stream(non_blocking=True)
    best = float("inf")
    for _ in range(rounds):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, 4, s.ptr)
        b.record(s)
        b.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(a, b) / 1e3)
    return nbytes / best


def references(cupy: Any, nbytes: int, rounds: int) -> dict[str, float]:
    step(f"large copies of {nbytes // MB} MB ...")
    dev = cupy.cuda.Memory(nbytes)
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    pageable = np.ones(nbytes, np.uint8)
    pin_ptr, page_ptr = int(pinned.ptr), int(pageable.ctypes.data)
    return {
        "h2d_pinned": timed_copy(cupy, dev.ptr, pin_ptr, nbytes, rounds),
        "d2h_pinned": timed_copy(cupy, pin_ptr, dev.ptr, nbytes, rounds),
        "h2d_pageable": timed_copy(cupy, dev.ptr, page_ptr, nbytes, rounds),
        "d2h_pageable": timed_copy(cupy, page_ptr, dev.ptr, nbytes, rounds),
    }


def scattered(num_slots: int, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(rng.choice(num_slots // 2, n, replace=False) * 2).astype(np.int64)


async def engine_bandwidth(engine: Any, src: Any, dst: Any, batch: int, batches: int) -> float:
    rng = np.random.default_rng(0)
    plan = [
        (scattered(src.num_slots, batch, rng), scattered(dst.num_slots, batch, rng))
        for _ in range(batches)
    ]
    await engine.transfer(src, plan[0][0], dst, plan[0][1])  # warm-up: compile, pin
    t = time.perf_counter()
    handles = [engine.submit(src, s, dst, d) for s, d in plan]
    for h in handles:
        await h
    return batches * batch * src.slot_bytes / (time.perf_counter() - t)


def per_page_bandwidth(cupy: Any, src: Any, dst: Any, n: int) -> float:
    """One cudaMemcpyAsync per page: what the backend never does for small pages."""
    rng = np.random.default_rng(1)
    s_ids, d_ids = scattered(src.num_slots, n, rng), scattered(dst.num_slots, n, rng)
    stream = cupy.cuda.Stream(non_blocking=True)
    slot = src.slot_bytes
    t = time.perf_counter()
    for s, d in zip(s_ids.tolist(), d_ids.tolist()):
        cupy.cuda.runtime.memcpyAsync(dst.ptr + d * slot, src.ptr + s * slot, slot, 4, stream.ptr)
    stream.synchronize()
    return n * slot / (time.perf_counter() - t)


async def both_ways(
    engine: Any, host: Any, dev: Any, batch: int, batches: int
) -> tuple[float, float]:
    async with engine:
        h2d = await engine_bandwidth(engine, host, dev, batch, batches)
        d2h = await engine_bandwidth(engine, dev, host, batch, batches)
    return h2d, d2h


def page_moves(cupy: Any, quick: bool) -> dict[str, dict[str, float]]:
    from tierkv.runtime import TransferEngine, run
    from tierkv.runtime.cuda_backend import CudaBackend

    arena_bytes = (256 if quick else 1024) * MB
    out: dict[str, dict[str, float]] = {}
    for page in (16 * KB, 256 * KB, 1 * MB):
        step(f"page moves, {page // KB} KB pages ...")
        backend = CudaBackend()
        n = arena_bytes // page
        host = backend.create_arena("host", page, n, kind="pinned")
        dev = backend.create_arena("dev", page, n)
        host.allocate(n)
        dev.allocate(n)
        host.pin_all()  # pinning is measured separately, not inside the copy figure
        batch = max(1, (16 * MB) // page)
        batches = max(4, min(64, (n // 2) // batch))

        engine = TransferEngine(backend, max_inflight=4)
        h2d, d2h = run(both_ways(engine, host, dev, batch, batches))
        out[f"{page // KB}KB"] = {
            "h2d_batched": h2d,
            "d2h_batched": d2h,
            "h2d_per_page": per_page_bandwidth(cupy, host, dev, min(n // 2, 4096)),
            "d2h_per_page": per_page_bandwidth(cupy, dev, host, min(n // 2, 4096)),
        }
        backend.close()
    return out


async def wait_figures(strategy: str, rounds: int) -> dict[str, float]:
    import cupy

    from tierkv.runtime.cuda_backend import CudaBackend

    backend = CudaBackend(wait_strategy=strategy)
    buf = cupy.zeros(1, dtype=cupy.uint8)
    s = backend.create_stream("s")

    def tiny() -> None:
        buf.fill(1)  # a tiny kernel on the stream (current on the launcher)

    waits, syncs = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        s.enqueue(tiny)
        await s.record_event()
        waits.append(time.perf_counter() - t)
        t = time.perf_counter()
        s.enqueue(tiny)
        await asyncio.to_thread(s.synchronize)
        syncs.append(time.perf_counter() - t)
    # Loop stall: a 0.5 ms ticker while 1,000 waits are in flight.
    stall = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal stall
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.0005)
            stall = max(stall, time.perf_counter() - t - 0.0005)

    tick = asyncio.create_task(ticker())
    for _ in range(10):
        events = []
        for _ in range(100):
            s.enqueue(tiny)
            events.append(s.record_event())
        await asyncio.gather(*(ev.wait() for ev in events))
    stop = True
    await tick
    backend.close()
    return {
        "latency_s": statistics.median(waits),
        "sync_s": statistics.median(syncs),
        "over_sync_s": statistics.median(waits) - statistics.median(syncs),
        "stall_s": stall,
    }


def demo(trace: str | None = None) -> dict[str, Any]:
    """``tierkv demo --backend cuda``; with ``trace``, its Chrome trace is written there."""
    if importlib.util.find_spec("tierkv.cli") is None:
        return {"status": "not available (tierkv.cli missing)"}
    step("tierkv demo --mode swap --backend cuda ...")
    cmd = [sys.executable, "-m", "tierkv.cli", "demo", "--mode", "swap", "--backend", "cuda"]
    out = subprocess.run(
        [*cmd, *(["--trace", trace] if trace else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(out.stdout[-3000:])
    return {"rc": out.returncode, "tail": (out.stdout + out.stderr)[-2000:]}


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    start_trace(args.trace)
    reason = unavailable_reason()
    if reason is not None:
        print(f"gpu_check: no GPU here ({reason}); nothing measured.")
        write_json(args.json, {"gpu": False, "reason": reason}, {})
        write_trace(args.trace)
        return 0
    import cupy

    from tierkv.runtime.cuda_stream import pick_wait_strategy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    figures: dict[str, Any] = {"gpu": True, "device": name, "cupy": cupy.__version__}
    with phase("cuda tests"):
        figures["tests"] = run_tests()
    with phase("reference copies"):
        figures["reference"] = references(
            cupy, (64 if args.quick else 256) * MB, 3 if args.quick else 5
        )
    with phase("page moves"):
        figures["pages"] = page_moves(cupy, args.quick)
    rounds = 50 if args.quick else 300
    figures["wait"] = {}
    for strategy in ("thread", "poll"):
        step(f"event waiting, {strategy} ...")
        from tierkv.runtime import run

        with phase(f"event waiting, {strategy}"):
            figures["wait"][strategy] = run(wait_figures(strategy, rounds))
    demo_trace = f"{args.trace}.demo.json" if args.trace else None
    with phase("tierkv demo --backend cuda"):
        figures["demo"] = demo(demo_trace)

    ref = figures["reference"]
    ratios: dict[str, Any] = {}
    rows = []
    for key in ("h2d", "d2h"):
        rows.append([f"{key} large pinned", ref[f"{key}_pinned"] / 1e9, 1.0, ""])
        rows.append(
            [
                f"{key} large pageable",
                ref[f"{key}_pageable"] / 1e9,
                ref[f"{key}_pageable"] / ref[f"{key}_pinned"],
                "",
            ]
        )
    targets = {"16KB": 0.6, "256KB": 0.85, "1MB": None}
    for page, f in figures["pages"].items():
        for key in ("h2d", "d2h"):
            r = f[f"{key}_batched"] / ref[f"{key}_pinned"]
            ratios[f"{page}_{key}_batched"] = r
            ratios[f"{page}_{key}_per_page"] = f[f"{key}_per_page"] / ref[f"{key}_pinned"]
            t = targets[page]
            rows.append(
                [f"{page} {key} batched", f[f"{key}_batched"] / 1e9, r, f">= {t}" if t else ""]
            )
            rows.append(
                [
                    f"{page} {key} per page",
                    f[f"{key}_per_page"] / 1e9,
                    ratios[f"{page}_{key}_per_page"],
                    "",
                ]
            )
    print()
    print(table(["copy", "GB/s", "ratio / large pinned", "target"], rows))
    wait = figures["wait"]
    print()
    print(
        table(
            ["strategy", "await us", "sync us", "over sync us", "max stall ms"],
            [
                [
                    k,
                    v["latency_s"] * 1e6,
                    v["sync_s"] * 1e6,
                    v["over_sync_s"] * 1e6,
                    v["stall_s"] * 1e3,
                ]
                for k, v in wait.items()
            ],
        )
    )
    ratios["recommended_wait_strategy"] = pick_wait_strategy(wait)
    ratios["max_stall_ms"] = {k: v["stall_s"] * 1e3 for k, v in wait.items()}
    print(f"\nrecommended wait strategy: {ratios['recommended_wait_strategy']}")
    print(f"cuda tests: {figures['tests']['summary']}; demo: {figures['demo']}")
    write_json(args.json, figures, ratios)
    parts: list[tuple[str, dict[str, Any]]] = []
    if demo_trace and os.path.exists(demo_trace):
        with open(demo_trace, encoding="utf-8") as f:
            parts.append(("tierkv demo --backend cuda", json.load(f)))
        os.remove(demo_trace)
    write_trace(args.trace, *parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
