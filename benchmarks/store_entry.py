"""The store's entry costs (issue 13, findings 5 and 7): opening the README's store, and a
1M-token prompt.

    python benchmarks/store_entry.py [--quick] [--json FILE] [--plot FILE.png]

open        ``KVStore(spec, device_bytes=8 << 30, host_bytes=64 << 30)`` (the README's) opened:
            seconds, and RSS growth as a share of the 72 GiB budget (arenas reserve address
            space only; the growth is bookkeeping).
prompt      ``add_sequence`` of a 1M-token list while a watchdog task counts loop turns: the
            longest gap between its turns (the loop's longest block) against the few-ms target
            (5 ms), and against the same checks and hashing done in one go (what the store did
            before: measured in the same run).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import parser, phase, table, write_json
from tierkv import KVSpec
from tierkv.keys import prefix_keys
from tierkv.runtime import new_event_loop
from tierkv.store import KVStore
from tierkv.validate import token_array

GIB = 1 << 30
TARGET_BLOCK_S = 0.005
README_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def open_readme_store() -> dict[str, float]:
    """Open and close the README's store; seconds and RSS growth."""
    before = rss_bytes()
    t0 = time.perf_counter()
    store = await KVStore(README_SPEC, device_bytes=8 << 30, host_bytes=64 << 30).open()
    seconds = time.perf_counter() - t0
    grown = rss_bytes() - before
    await store.close()
    return {"open_s": seconds, "rss_growth_bytes": grown, "budget_bytes": 72 * GIB}


async def long_prompt(n: int) -> dict[str, Any]:
    """add_sequence of ``n`` tokens with a watchdog; the gaps between the watchdog's turns."""
    tokens = list(range(n))
    gaps: list[float] = []
    done = False

    async def watchdog() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp16", page_tokens=16)
    async with KVStore(
        spec, device_bytes=64 * spec.page_bytes, host_bytes=256 * spec.page_bytes
    ) as s:
        dog = asyncio.create_task(watchdog())
        await asyncio.sleep(0)
        gaps.clear()
        t0 = time.perf_counter()
        await s.add_sequence("long", tokens)
        total = time.perf_counter() - t0
        done = True
        await dog
        t0 = time.perf_counter()  # the same work in one go, as one callback would do it
        arr = token_array(tokens)
        prefix_keys(arr, spec.page_tokens)
        arr.tolist()
        one_go = time.perf_counter() - t0
    return {
        "tokens": n,
        "total_s": total,
        "longest_block_s": max(gaps) if gaps else total,
        "loop_turns": len(gaps),
        "one_go_s": one_go,
        "gaps": gaps,
    }


async def main_async(quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    with phase("open"):
        opened = await open_readme_store()
    with phase("prompt"):
        prompt = await long_prompt(100_000 if quick else 1_000_000)
    return opened, prompt


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--plot", type=Path, help="draw the loop's gaps while hashing (PNG)")
    args = p.parse_args()
    opened, prompt = new_event_loop().run_until_complete(main_async(args.quick))
    share = opened["rss_growth_bytes"] / opened["budget_bytes"]
    print(
        table(
            ["README store", "open (s)", "RSS growth (MiB)", "of the 72 GiB budget"],
            [["8 GiB + 64 GiB", opened["open_s"], opened["rss_growth_bytes"] / 2**20, share]],
        )
    )
    block_ratio = prompt["longest_block_s"] / TARGET_BLOCK_S
    print(
        table(
            ["prompt", "add (s)", "loop turns", "longest block (ms)", "of 5 ms", "in one go (ms)"],
            [
                [
                    f"{prompt['tokens']:,} tokens",
                    prompt["total_s"],
                    prompt["loop_turns"],
                    prompt["longest_block_s"] * 1e3,
                    block_ratio,
                    prompt["one_go_s"] * 1e3,
                ]
            ],
        )
    )
    figures = {**opened, **{k: v for k, v in prompt.items() if k != "gaps"}}
    write_json(args.json, figures, {"rss_of_budget": share, "block_of_5ms": block_ratio})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([g * 1e3 for g in prompt["gaps"]], lw=0.8)
        ax.axhline(TARGET_BLOCK_S * 1e3, color="red", ls="--", label="5 ms")
        ax.set_xlabel("loop turn during add_sequence")
        ax.set_ylabel("gap (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
