"""Page-table throughput: lookup + touch + prepare/complete pairs, 10^3 to 10^6 resident pages.

An operation is one page passing through one call (a lookup of 32 keys is 32 operations; a
prepare/complete pair on a page is one). The figure to reach is 1,000,000 operations per second on
one core at 10^6 resident pages, and a flat curve (within 2x) from 10^3 to 10^6 pages.

    python benchmarks/page_table.py [--quick] [--json FILE] [--policy NAME]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parser, table, write_json

from tierkv import DEFAULT_POLICY, PageTable

BATCH = 32
TARGET = 1_000_000


def keys(start: int, n: int) -> list[bytes]:
    """``n`` distinct 16-byte keys."""
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def run(pages: int, policy: str, seconds: float) -> float:
    """Operations per second on a table holding ``pages`` pages."""
    table_ = PageTable({"host": pages}, policy, record_events=False)
    alloc = table_.prepare_store(keys(0, pages), "host")
    assert alloc is not None
    table_.complete_store(alloc.keys, "host")
    resident = keys(0, pages)
    pos = {k: i for i, k in enumerate(resident)}
    fresh = pages
    ops = 0
    i = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        for _ in range(20):
            # a request: its prefix (resident) and a few new pages
            j = (i * 7919) % max(1, pages - BATCH)
            hit = resident[j : j + BATCH]
            table_.lookup(hit, "host")
            table_.prepare_load(hit, "host")
            table_.complete_load(hit, "host")
            table_.touch(hit, "host")
            new = keys(fresh, BATCH // 4)
            fresh += BATCH // 4
            a = table_.prepare_store(new, "host")
            assert a is not None
            table_.complete_store(a.keys, "host")
            for old, k in zip(a.evicted, a.keys):  # keep `resident` equal to the table's keys
                idx = pos.pop(old)
                resident[idx] = k
                pos[k] = idx
            ops += 3 * len(hit) + len(new)
            i += 1
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - t0
    table_.check()
    return ops / elapsed


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--policy", default=DEFAULT_POLICY)
    args = p.parse_args()
    sizes = [10**3, 10**4, 10**5, 10**6]
    seconds = 0.5 if args.quick else 2.0
    rates = {}
    for n in sizes:
        rates[n] = run(n, args.policy, seconds)
    rows = [[n, rates[n], rates[n] / TARGET] for n in sizes]
    print(f"page table, policy {args.policy}, batches of {BATCH} keys, one core")
    print(table(["resident pages", "ops/s", "of 1M target"], rows))
    flat = max(rates.values()) / min(rates.values())
    print(f"flatness (max/min over 10^3..10^6): {flat:.2f} (target <= 2)")
    write_json(
        args.json,
        {"policy": args.policy, "ops_per_s": {str(n): r for n, r in rates.items()}},
        {"ops_at_1e6_of_target": rates[10**6] / TARGET, "max_over_min": flat},
    )


if __name__ == "__main__":
    main()
