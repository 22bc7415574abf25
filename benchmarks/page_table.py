"""Page-table throughput: lookup + touch + prepare/complete pairs, 10^3 to 10^6 resident pages.

An operation is one page passing through one call (a lookup of 32 keys is 32 operations; a
prepare/complete pair on a page is one). The figure to reach is 1,000,000 operations per second on
one core at 10^6 resident pages, and a flat curve (within 2x) from 10^3 to 10^6 pages.

The sizes run interleaved (``--rounds`` slices each), and each figure is all of its operations
over all of its time, so load from other processes on a shared machine falls on every size alike.
Two rates are printed: over wall-clock time, and over the CPU time the process got
(``time.process_time``). They agree on an idle machine; on a shared one the CPU figure is the
rate "on one core" (the time this process was not running is not the table's), and the target
ratio uses it. Both go to the JSON.

    python benchmarks/page_table.py [--quick] [--json FILE] [--policy NAME] [--rounds N]
                                    [--trace FILE.json]

--trace writes each size's slices (and the table builds) as spans of a Chrome trace.
"""

from __future__ import annotations

import os
import sys
import time

# the repository first: benchmarks/transports.py must not shadow the transports package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import parser, phase, span, start_trace, table, write_json, write_trace
from tierkv import DEFAULT_POLICY, PageTable

BATCH = 32
TARGET = 1_000_000


def keys(start: int, n: int) -> list[bytes]:
    """``n`` distinct 16-byte keys."""
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


class Workload:
    """A one-tier table holding ``pages`` pages and the request stream that drives it."""

    def __init__(self, pages: int, policy: str) -> None:
        self.pages = pages
        self.table = PageTable({"host": pages}, policy, record_events=False)
        alloc = self.table.prepare_store(keys(0, pages), "host")
        assert alloc is not None
        self.table.complete_store(alloc.keys, "host")
        # the key in each slot: the harness's own bookkeeping is a list store per new page,
        # not a pop and an insert on a second dict of 10^6 keys (once ~10% of the time)
        self.resident: list[bytes] = [b""] * pages
        for k, s in zip(alloc.keys, alloc.slots):
            self.resident[s] = k
        self.fresh = pages
        self.i = 0
        self.ops = 0
        self.elapsed = 0.0
        self.cpu = 0.0

    def step(self, seconds: float) -> None:
        """Run requests for about ``seconds``; add to ``ops`` and ``elapsed``."""
        table_, resident, pages = self.table, self.resident, self.pages
        ops, i, fresh = 0, self.i, self.fresh
        c0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while True:
            for _ in range(20):
                # a request: 32 resident pages in neighbouring slots, and a few new pages
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
                for s, k in zip(a.slots, a.keys):  # keep `resident` equal to the table's keys
                    resident[s] = k
                ops += 3 * len(hit) + len(new)
                i += 1
            if time.perf_counter() >= deadline:
                break
        t1 = time.perf_counter()
        self.cpu += time.process_time() - c0
        self.elapsed += t1 - t0
        span(f"{pages:,} pages", t0, t1, ops=ops)
        self.ops += ops
        self.i, self.fresh = i, fresh


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--policy", default=DEFAULT_POLICY)
    p.add_argument("--rounds", type=int, default=8, help="interleaved slices per size")
    args = p.parse_args()
    start_trace(args.trace)
    sizes = [10**3, 10**4, 10**5, 10**6]
    seconds = 0.5 if args.quick else 2.0
    print(f"building tables of {', '.join(f'{n:,}' for n in sizes)} pages ...", flush=True)
    loads = []
    for n in sizes:
        with phase(f"build {n:,} pages"):
            loads.append(Workload(n, args.policy))
    # the sizes take turns, so a neighbour's burst on a shared machine hits them all alike;
    # each figure is all its operations over all its time (no best-of)
    for r in range(args.rounds):
        for w in loads:
            w.step(seconds / args.rounds)
        print(f"\rround {r + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for w in loads:
        w.table.check()
    rates = {w.pages: w.ops / w.elapsed for w in loads}
    cpu_rates = {w.pages: w.ops / max(w.cpu, 1e-9) for w in loads}
    rows = [[n, rates[n], cpu_rates[n], cpu_rates[n] / TARGET] for n in sizes]
    print(f"page table, policy {args.policy}, batches of {BATCH} keys, one core")
    print(table(["resident pages", "ops/s (wall)", "ops/s (cpu)", "of 1M target (cpu)"], rows))
    flat = max(cpu_rates.values()) / min(cpu_rates.values())
    flat_wall = max(rates.values()) / min(rates.values())
    busy = sum(w.cpu for w in loads) / sum(w.elapsed for w in loads)
    print(
        f"flatness (max/min over 10^3..10^6): {flat:.2f} cpu, {flat_wall:.2f} wall (target <= 2); "
        f"the process ran {busy:.0%} of the wall time"
    )
    write_json(
        args.json,
        {
            "policy": args.policy,
            "ops_per_s": {str(n): r for n, r in rates.items()},
            "ops_per_cpu_s": {str(n): r for n, r in cpu_rates.items()},
            "cpu_share": busy,
        },
        {
            "ops_at_1e6_of_target": cpu_rates[10**6] / TARGET,
            "wall_ops_at_1e6_of_target": rates[10**6] / TARGET,
            "max_over_min": flat,
        },
    )
    write_trace(args.trace)


if __name__ == "__main__":
    main()
