"""The loop at scale (issue 17): many sequences without stalls.

1. **10,000 idle sequences**, each with a 48-token prompt whose KV (3 blocks x 4 layers = 12
   pages) was appended through a lease: the time a full collector pass spends on them (the pass
   over the store before and after they exist, with the rest of the process frozen; best of 5;
   default thresholds), the whole process's full pass beside it, the tracked objects they add,
   and (on 1,000 more, traced) the Python heap each holds, split into the sequence's own
   bookkeeping and its pages' (the page table, the policy, the tier maps; by allocating file).
2. **1,000 concurrent sequences** decoding through one store (``benchmarks/decode.py``'s stall
   check): the longest loop callback and the 1 ms timer's p99 lateness, with the collector's
   default settings, scheduled by 32 workers (continuous batching: the target) and by a task per
   sequence behind a semaphore (reported), and after :func:`tierkv.settle_collector`. The
   hypervisor's steal (``/proc/stat``) in the longest callbacks and in the run is reported
   beside them: on a VM, stolen time counts as the running thread's CPU time too.

Run: ``python benchmarks/loop_scale.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import parser, phase, table, write_json
from benchmarks.decode import stall_check
from tierkv import KVSpec
from tierkv.keys import page_key
from tierkv.store import KVStore

# allocations made for pages rather than for a sequence (the page table, the policies, the
# tiers' maps, the owners' per-page counts and pins, the page keys): the bookkeeping figure is
# the rest
_PAGE_FILES = (
    "page_table.py",
    "policies",
    "tiers.py",
    "owners.py",
    "eviction.py",
    "lower_tiers.py",
    "arena.py",
)


def _full_pass_ms(reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _split(diff: list[tracemalloc.StatisticDiff]) -> tuple[int, int]:
    first = page_key.__code__.co_firstlineno
    pages = seqs = 0
    for d in diff:
        frame = d.traceback[0]
        name = frame.filename
        in_page_key = name.endswith("keys.py") and first <= frame.lineno <= first + 3
        if in_page_key or any(p in name for p in _PAGE_FILES):
            pages += d.size_diff
        else:
            seqs += d.size_diff
    return seqs, pages


async def _grow(store: KVStore, spec: KVSpec, first: int, n: int) -> None:
    k = torch.zeros(spec.num_kv_heads, 48, spec.head_dim, dtype=spec.dtype)
    for i in range(first, first + n):
        sid = f"s{i}"
        await store.add_sequence(sid, [(i * 7919 + t) % 50_000 for t in range(48)])
        async with store.lease([sid]) as lease:
            for layer in range(spec.num_layers):
                await lease.append(sid, layer, k, k)
    await store.drain()


async def idle_sequences(n: int, traced: int = 1_000) -> dict[str, Any]:
    """``n`` idle sequences of 48 tokens with their KV appended; see the module docstring.

    The pass time the sequences add is measured with the rest of the process frozen (torch's
    ~169k objects would make it the difference of two ~100 ms figures that vary by tens of ms
    on a shared machine): frozen before the store exists, so a full pass walks the store's own
    structures and whatever the sequences added, before and after them. A full pass of the
    whole process (nothing frozen) is reported beside it. The heap per sequence is measured on
    ``traced`` more, under tracemalloc (which slows allocation and would skew the pass
    times)."""
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="fp16", page_tokens=16)
    per = spec.bytes_for(48)
    total = n + traced
    gc.collect()
    gc.freeze()
    try:
        async with KVStore(
            spec, device_bytes=per * total // 4, host_bytes=per * total * 2
        ) as store:
            await _grow(store, spec, -1, 1)  # warm-up: first-use allocations are not per sequence
            base_ms = _full_pass_ms(5)
            base_objects = len(gc.get_objects())
            t0 = time.perf_counter()
            await _grow(store, spec, 0, n)
            build_s = time.perf_counter() - t0
            pass_ms = _full_pass_ms(5)
            objects = len(gc.get_objects()) - base_objects
            gc.unfreeze()
            whole_ms = _full_pass_ms()
            tracemalloc.start(1)
            before = tracemalloc.take_snapshot()
            await _grow(store, spec, n, traced)
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            seq_bytes, page_bytes = _split(after.compare_to(before, "lineno"))
            gc.collect()
            gc.freeze()
            frozen_ms = _full_pass_ms()
    finally:
        gc.unfreeze()
    return {
        "sequences": n,
        "build_s": build_s,
        "full_pass_store_before_ms": base_ms,
        "full_pass_store_ms": pass_ms,
        "full_pass_added_ms": pass_ms - base_ms,
        "full_pass_whole_process_ms": whole_ms,
        "full_pass_frozen_ms": frozen_ms,
        "tracked_objects_per_sequence": objects / n,
        "bookkeeping_bytes_per_sequence": seq_bytes / traced,
        "page_bytes_per_sequence": page_bytes / traced,
    }


def _idle_in_a_process(n: int) -> dict[str, Any]:
    return asyncio.run(idle_sequences(n))


def _gens(stall: dict[str, Any]) -> str:
    return "/".join(str(n) for n in stall["collector_passes_by_generation"])


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    n = 2_000 if args.quick else 10_000
    # in a process of its own: eleven thousand sequences allocated and freed move glibc's
    # dynamic mmap and trim thresholds, after which the next phase's small allocations grow and
    # trim the heap (tens of ms of kernel time in one callback, whichever code allocates)
    with phase(f"{n} idle sequences"), ProcessPoolExecutor(1, get_context("spawn")) as pool:
        idle = pool.submit(_idle_in_a_process, n).result()
    steps = 4 if args.quick else 8
    with phase("1000 sequences, default collector (32 workers)"):
        plain = asyncio.run(stall_check(1000, steps))
    with phase("1000 sequences, default collector (a task per sequence)"):
        tasks = asyncio.run(stall_check(1000, steps, scheduler="tasks"))
    with phase("1000 sequences, settled collector (32 workers)"):
        settled = asyncio.run(stall_check(1000, steps, settle=True))
    rows = [
        [f"{n} idle: full pass ms added by the sequences", idle["full_pass_added_ms"], "<= 10"],
        [f"{n} idle: ... store's pass before them", idle["full_pass_store_before_ms"], "reported"],
        [f"{n} idle: whole process full pass ms", idle["full_pass_whole_process_ms"], "reported"],
        [f"{n} idle: full pass ms, all frozen", idle["full_pass_frozen_ms"], "reported"],
        ["idle: tracked objects / sequence", idle["tracked_objects_per_sequence"], "reported"],
        ["idle: bookkeeping bytes / sequence", idle["bookkeeping_bytes_per_sequence"], "<= 4096"],
        ["idle: page bytes / sequence (12 pages)", idle["page_bytes_per_sequence"], "reported"],
    ]
    for name, r, target in (
        ("workers", plain, True),
        ("tasks", tasks, False),
        ("settled", settled, False),
    ):
        goal = "<= 10" if target else "reported"
        rows += [
            [f"{name}: longest callback ms", r["max_callback_ms"], goal],
            [f"{name}: ... outside collector ms", r["max_callback_outside_gc_ms"], "reported"],
            [
                f"{name}: ... CPU outside collector ms",
                r["max_callback_cpu_outside_gc_ms"],
                "reported",
            ],
            [f"{name}: steal in the longest ms", r["max_callback_steal_ms"], "reported"],
            [
                f"{name}: steal in the longest CPU ms",
                r["max_callback_cpu_outside_gc_steal_ms"],
                "reported",
            ],
            [f"{name}: steal in the run ms", r["run_steal_ms"], "reported"],
            [f"{name}: longest collector pass ms", r["max_gc_pause_ms"], "reported"],
            [
                f"{name}: 1 ms timer p99 late ms",
                r["p99_timer_lateness_ms"],
                "<= 5" if target else "reported",
            ],
            [f"{name}: collector passes gen 0/1/2", _gens(r), "gen 2: 0" if target else "reported"],
            [f"{name}: callbacks / lease-step", r["callbacks_per_lease_step"], "reported"],
            [
                f"{name}: gen-2 growth / 1000 lease-steps",
                r["oldest_generation_growth_per_1000_lease_steps"],
                "reported",
            ],
            [f"{name}: seconds", r["seconds"], "reported"],
        ]
    print(table(["figure", "value", "target"], rows))
    print(
        f"longest callback: {plain['max_callback']}; by CPU time: {plain['max_callback_cpu']};"
        f" load {os.getloadavg()[0]:.2f}"
    )
    ratios = {
        "idle_pass_added_of_10ms": idle["full_pass_added_ms"] / 10,
        "idle_bookkeeping_of_4KiB": idle["bookkeeping_bytes_per_sequence"] / 4096,
        "longest_callback_of_10ms": plain["max_callback_ms"] / 10,
        "longest_callback_cpu_outside_gc_of_10ms": plain["max_callback_cpu_outside_gc_ms"] / 10,
        "timer_p99_of_5ms": plain["p99_timer_lateness_ms"] / 5,
    }
    write_json(
        args.json, {"idle": idle, "default": plain, "tasks": tasks, "settled": settled}, ratios
    )


if __name__ == "__main__":
    main()
