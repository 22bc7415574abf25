"""The store's CPU time per decode layer call against the torch floor (issue 26).

    python benchmarks/step.py [--quick] [--json FILE] [--batches 1,32]

A SmolLM2-135M layout (30 layers, 3 KV heads, head dim 64, fp32, 16-token pages); ``B``
sequences of 1,024 tokens; the device tier holds 45% of their KV, the host all of it. Decode
steps alternate, on the same store and sequences, between:

* **lease**: today's path, as ``TieredCache`` ran it: per layer one lease, an append and a
  ``kv`` per sequence, the rows stacked to ``[B, H, S, D]``, the next two layers prefetched
  after every second layer;
* **step**: the step path (``store.step_plan``): per layer one ``await step.layer(L)``, one
  ``append`` (two ``index_copy_``), one ``kv`` (one ``index_select``).

The **floor** is the copies alone: the ``index_copy_`` of the new tokens and the
``index_select`` of the layer's K/V, on the same arena with the same index tensors, run inside
the step path's layers (before the store's calls on even layers, after on odd ones, so that
neither finds the other's cache lines more often).

Figures are the caller thread's CPU time (``time.thread_time``: the copy threads and the other
agents on a shared machine are not in it) per layer call, the median over steps; the floor's
time is taken out of the step's. Ratios: store time per layer call / floor per layer call
(targets: step <= 3.0 at batch 1, <= 1.5 at batch 32), the step's the median over steps of
each step's store time against the floor measured inside that same step (so a noisy floor
moves one step's ratio, not the figure); ``step_ratio_of_medians`` is the old reading.

A third kind of step runs in the rotation, **buf**: the step path gathering into a reused
tensor (``kv_padded(out=)``, as the serving engine does) against a floor gathering into a
reused tensor too (``index_select(out=)``): without the page faults of a new 48 MB tensor per
layer (batch 32) the floor is less than half, so the same store work weighs more in it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import add_trace_flag, table, write_json
from tierkv import KVSpec
from tierkv.store import KVStore

SPEC = KVSpec(30, 3, 64, torch.float32, 16)
CONTEXT = 1024
DEVICE_SHARE = 0.45
AHEAD = 2
TARGETS = {1: 3.0, 32: 1.5}


def _ahead(layer: int, layers: int, window: int) -> list[int] | None:
    # TieredCache's prefetch rule before the step path (tierkv.integrations.hf, issue 26)
    if (layer + 1) % window and layer != layers - 1:
        return None
    return [(layer + 1 + i) % layers for i in range(min(window, layers - 1))]


async def lease_step(store: KVStore, ids: list[str], kvs: list[torch.Tensor]) -> float:
    """One decode step on the lease path; returns the caller's CPU seconds."""
    layers = SPEC.num_layers
    c0 = time.thread_time()
    for layer in range(layers):
        k, v = kvs[layer]
        async with store.lease(ids, [layer]) as lease:
            for b, sid in enumerate(ids):
                await lease.append(sid, layer, k[b], v[b])
            out = [lease.kv(sid, layer) for sid in ids]
        if len(ids) > 1:
            torch.stack([kk for kk, _ in out]), torch.stack([vv for _, vv in out])
        ahead = _ahead(layer, layers, AHEAD)
        if ahead is not None:
            await store.prefetch(ids, ahead, wait=False)
    store.step()
    for sid in ids:
        store.add_tokens(sid, [1])
    return time.thread_time() - c0


Buffers = tuple[torch.Tensor, torch.Tensor] | None


async def plan_step(
    store: KVStore, ids: list[str], kvs: list[torch.Tensor], bufs: Buffers = None
) -> tuple[float, float]:
    """One decode step on the step path; returns (the store's CPU seconds, the floor's). With
    ``bufs`` both gather into a reused tensor (``kv_padded(out=)`` and ``index_select(out=)``)
    instead of a new one each layer."""
    floor = 0.0
    d = SPEC.head_dim
    c0 = time.thread_time()
    async with store.step_plan(ids, tokens=1, ahead=AHEAD) as step:
        for layer in range(SPEC.num_layers):
            k, v = kvs[layer]
            h = await step.layer(layer)
            if layer % 2 == 0:
                floor += _floor(step.flat, h, k, v, d, bufs)
            h.append(k, v)
            if bufs is None:
                h.kv()
            else:
                h.kv_padded(out=bufs[0])
            if layer % 2 == 1:
                floor += _floor(step.flat, h, k, v, d, bufs)
    store.step()
    for sid in ids:
        store.add_tokens(sid, [1])
    return time.thread_time() - c0 - floor, floor


def _floor(
    flat: torch.Tensor, h: Any, k: torch.Tensor, v: torch.Tensor, d: int, bufs: Buffers
) -> float:
    """The copies alone, on the same tensors: returns their CPU seconds."""
    rows = h._rows  # the layer's precomputed index tensors (benchmark-only peek)
    kr, vr = rows.k_rows(True), rows.v_rows(True)  # (built outside the timed part)
    out = None if bufs is None else bufs[1].view(-1)[: rows.read.numel() * d].view(-1, d)
    c0 = time.thread_time()
    flat.index_copy_(0, kr, k.reshape(-1, d))
    flat.index_copy_(0, vr, v.reshape(-1, d))
    if out is None:
        flat.index_select(0, rows.read)
    else:
        torch.index_select(flat, 0, rows.read, out=out)
    return time.thread_time() - c0


async def _filled(batch: int, seed: int) -> tuple[KVStore, list[str]]:
    """A store holding ``batch`` sequences of CONTEXT - 1 tokens (one more declared)."""
    total = batch * SPEC.num_layers * (CONTEXT // SPEC.page_tokens + 2)
    device = int(total * DEVICE_SHARE) * SPEC.page_bytes
    host = (total + 64) * SPEC.page_bytes
    g = torch.Generator().manual_seed(seed)
    store = KVStore(
        SPEC, device_bytes=device, host_bytes=host, codec=None, turn_budget=None, timeout=120.0
    )
    await store.open()
    ids = [f"s{b}" for b in range(batch)]
    for sid in ids:
        await store.add_sequence(sid, [])
    shape = (batch, SPEC.num_kv_heads, CONTEXT - 1, SPEC.head_dim)
    async with store.step_plan(ids, tokens=CONTEXT - 1, ahead=AHEAD) as step:
        for layer in range(SPEC.num_layers):
            h = await step.layer(layer)
            h.append(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    store.step()
    for sid in ids:
        store.add_tokens(sid, [1])
    return store, ids


async def run_batch(batch: int, steps: int) -> dict[str, Any]:
    """Alternating steps of the two paths, each on a store of its own (the same layout and
    budgets, the same sequences and new KV)."""
    g = torch.Generator().manual_seed(batch)
    one = (batch, SPEC.num_kv_heads, 1, SPEC.head_dim)
    kvs = [
        (torch.randn(one, generator=g), torch.randn(one, generator=g))
        for _ in range(SPEC.num_layers)
    ]
    leased, ids = await _filled(batch, 1)
    planned, _ = await _filled(batch, 1)
    rows = batch * 2 * SPEC.num_kv_heads * (CONTEXT + 2 * steps + 16) * SPEC.head_dim
    bufs = (torch.empty(rows), torch.empty(rows))  # the gathers' reused outputs (one each)
    try:
        for _ in range(2):  # warm-up: a step of each
            await lease_step(leased, ids, kvs)
            await plan_step(planned, ids, kvs)
            await plan_step(planned, ids, kvs, bufs)
        lease_s: list[float] = []
        step_s: list[float] = []
        floor_s: list[float] = []
        buf_s: list[float] = []
        buf_floor_s: list[float] = []
        loads = [leased.stats()["page_loads"], planned.stats()["page_loads"]]
        order = ("lease", "step", "buf")
        for r in range(steps):  # alternate, the order rotating each round
            for which in order[r % 3 :] + order[: r % 3]:
                if which == "lease":
                    lease_s.append(await lease_step(leased, ids, kvs))
                elif which == "step":
                    s, f = await plan_step(planned, ids, kvs)
                    step_s.append(s)
                    floor_s.append(f)
                else:
                    s, f = await plan_step(planned, ids, kvs, bufs)
                    buf_s.append(s)
                    buf_floor_s.append(f)
        sl, sp = leased.stats(), planned.stats()
        leased.check()
        planned.check()
    finally:
        await leased.close()
        await planned.close()
    n = SPEC.num_layers
    lease_us = statistics.median(lease_s) / n * 1e6
    step_us = statistics.median(step_s) / n * 1e6
    floor_us = statistics.median(floor_s) / n * 1e6
    pages = batch * n * (CONTEXT // SPEC.page_tokens + 1) * steps
    return {
        "batch": batch,
        "steps": steps,
        "lease_us_per_layer": lease_us,
        "step_us_per_layer": step_us,
        "floor_us_per_layer": floor_us,
        "buffer_step_us_per_layer": statistics.median(buf_s) / n * 1e6,
        "buffer_floor_us_per_layer": statistics.median(buf_floor_s) / n * 1e6,
        # each step against the floor measured inside it (the same load), then the median:
        # a noisy floor in one step moves one ratio, not the figure
        "lease_ratio": lease_us / floor_us,
        "step_ratio": statistics.median(a / b for a, b in zip(step_s, floor_s)),
        "buffer_step_ratio": statistics.median(a / b for a, b in zip(buf_s, buf_floor_s)),
        "step_ratio_of_medians": step_us / floor_us,
        "step_ratios": [a / b for a, b in zip(step_s, floor_s)],
        "target": TARGETS.get(batch),
        "lease_loads_per_page": (sl["page_loads"] - loads[0]) / pages,
        "step_loads_per_page": (sp["page_loads"] - loads[1]) / pages / 2,  # (two step kinds)
        "step_late_fetches": sp["late_fetches"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--json", metavar="FILE", help="write figures and ratios as JSON")
    p.add_argument("--batches", default="1,32", help="batch sizes (comma-separated)")
    add_trace_flag(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    rows, figures, ratios = [], {}, {}
    for b in batches:
        steps = (4 if args.quick else 10) if b < 8 else (3 if args.quick else 6)
        r = asyncio.run(run_batch(b, steps))
        figures[f"batch_{b}"] = r
        ratios[f"step_vs_floor_b{b}"] = r["step_ratio"]
        ratios[f"lease_vs_floor_b{b}"] = r["lease_ratio"]
        ratios[f"buffer_step_vs_floor_b{b}"] = r["buffer_step_ratio"]
        rows.append(
            [
                b,
                r["floor_us_per_layer"],
                r["lease_us_per_layer"],
                r["step_us_per_layer"],
                r["lease_ratio"],
                r["step_ratio"],
                r["target"] or "-",
                r["buffer_floor_us_per_layer"],
                r["buffer_step_us_per_layer"],
                r["buffer_step_ratio"],
            ]
        )
    head = ["batch", "floor us", "lease us", "step us", "lease/floor", "step/floor", "target"]
    print(table([*head, "buf floor us", "buf step us", "buf step/floor"], rows))
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
