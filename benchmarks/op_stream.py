"""Page table on a vLLM-style op stream: the calls a KV connector makes per request.

Per request (a chain of prefix blocks: a shared system prompt, then a conversation's own
blocks, each turn longer than the last)::

    lookup(blocks) -> h; touch(hits); prepare_load(hits)
    prepare_store(misses, hints) ; complete_store(stored) ; complete_load(hits)

with the hints built per request inside the timed loop: one :class:`~tierkv.policies.ChainHint`
per request, from which the table derives each block's hint (``--page-hints`` builds a
``PageHint`` per block instead, ``--no-hints`` passes none). An operation is one block through
one call, as in ``benchmarks/page_table.py``. Every policy runs
at 10^3 to 10^6 pages, interleaved, and its rate is printed beside LRU's from the same run (issue
17: the default policy and ARC >= 0.5 of LRU's rate). Rates are per CPU second of this process
(``time.process_time``), so a shared machine's other load is not counted. kvaware runs its C
loops where the extension was built (``TIERKV_NATIVE_POLICY=0``: the Python ones); the header
says which.

    python benchmarks/op_stream.py [--quick] [--json FILE] [--policy NAME ...]
                                   [--no-hints | --page-hints] [--trace FILE.json]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks._common import parser, phase, span, start_trace, table, write_json, write_trace
from tierkv import DEFAULT_POLICY, PageHint, PageTable
from tierkv.policies import ChainHint
from tierkv.policies.kvaware_loops import LOOPS

SYSTEM = 8  # shared system-prompt blocks every request starts with
TURN = (2, 12)  # blocks a conversation adds per turn (uniform)
MAX_BLOCKS = 96  # a conversation starts over past this


class Stream:
    """Requests of Zipf-popular conversations whose universe is 4x the tier's pages."""

    def __init__(self, pages: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.conversations = max(8, pages // 12)
        self.rng = rng
        self.length = [0] * self.conversations
        self.base = [0] * self.conversations
        self.fresh = 1 << 40  # block ids of conversation turns (the system prompt is 0..7)

    def requests(self, n: int) -> list[list[int]]:
        """``n`` requests, drawn before any timing starts."""
        picks = (self.rng.zipf(1.2, n) - 1) % self.conversations
        grow = self.rng.integers(TURN[0], TURN[1] + 1, n)
        out: list[list[int]] = []
        for c, g in zip(picks.tolist(), grow.tolist()):
            if self.length[c] + g > MAX_BLOCKS or not self.length[c]:
                self.base[c] = self.fresh  # a new conversation in this slot
                self.fresh += MAX_BLOCKS
                self.length[c] = 0
            self.length[c] += g
            out.append(list(range(SYSTEM)) + [self.base[c] + j for j in range(self.length[c])])
        return out


class Workload:
    """One table of ``pages`` pages under one policy, and its own request stream."""

    def __init__(self, pages: int, policy: str, hints: str) -> None:
        self.pages, self.policy, self.hints = pages, policy, hints
        self.table = PageTable({"t": pages}, policy, record_events=False)
        self.stream = Stream(pages)
        self.ops = 0
        self.cpu = 0.0
        self.hits = self.blocks = 0
        self.run(self.stream.requests(max(200, pages // 8)), timed=False)  # warm: a full tier

    def run(self, requests: list[list[int]], timed: bool = True) -> None:
        t = self.table
        lookup, touch, prepare_load, complete_load = (
            t.lookup,
            t.touch,
            t.prepare_load,
            t.complete_load,
        )
        prepare_store, complete_store = t.prepare_store, t.complete_store
        chained, per_page = self.hints == "chain", self.hints == "page"
        ops = hits = blocks = 0
        c0 = time.process_time()
        w0 = time.perf_counter()
        for ids in requests:
            n = len(ids)
            h = lookup(ids, "t")
            hit = ids[:h]
            if h:
                touch(hit, "t")
                prepare_load(hit, "t")
            miss = ids[h:]
            hints: list[PageHint] | ChainHint | None = None
            if chained:
                hints = ChainHint(h, ids[h - 1] if h else None, h, n)
            elif per_page:
                hints = [
                    PageHint(j, j == n - 1, h, ids[j - 1] if j else None, n) for j in range(h, n)
                ]
            alloc = prepare_store(miss, "t", hints)
            stored = 0
            if alloc is not None:
                complete_store(alloc.keys, "t")
                stored = len(alloc.keys)
            if h:
                complete_load(hit, "t")
            ops += n + 3 * h + len(miss) + stored
            hits += h
            blocks += n
        if timed:
            self.cpu += time.process_time() - c0
            self.ops += ops
            self.hits += hits
            self.blocks += blocks
            span(f"{self.policy} {self.pages:,}", w0, time.perf_counter(), ops=ops)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--policy", action="append", help="repeatable; default: lru, arc, default")
    p.add_argument("--no-hints", action="store_true", help="pass no hints (as KVStore does)")
    p.add_argument("--page-hints", action="store_true", help="a PageHint per block, not a chain")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    start_trace(args.trace)
    policies = args.policy or ["lru", "arc", DEFAULT_POLICY]
    if "lru" not in policies:
        policies = ["lru", *policies]
    sizes = [10**3, 10**4, 10**5] + ([] if args.quick else [10**6])
    per_round = 400 if args.quick else 1500
    loads: dict[tuple[str, int], Workload] = {}
    form = "none" if args.no_hints else "page" if args.page_hints else "chain"
    for n in sizes:
        for pol in policies:
            with phase(f"build {pol} {n:,}"):
                print(f"\rbuilding {pol} at {n:,} pages ...", end="", file=sys.stderr, flush=True)
                loads[pol, n] = Workload(n, pol, form)
    print(file=sys.stderr)
    for r in range(args.rounds):  # interleaved: every (policy, size) gets each round's load
        for w in loads.values():
            w.run(w.stream.requests(per_round))
        print(f"\rround {r + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for w in loads.values():
        w.table.check()
    rate = {key: w.ops / max(w.cpu, 1e-9) for key, w in loads.items()}
    rows = []
    for n in sizes:
        for pol in policies:
            w = loads[pol, n]
            rows.append(
                [n, pol, rate[pol, n], rate[pol, n] / rate["lru", n], w.hits / max(1, w.blocks)]
            )
    hints = {
        "none": "no hints",
        "page": "a PageHint per block, built per request",
        "chain": "a ChainHint per request",
    }[form]
    loops = "C (tierkv.policies._kvaware)" if LOOPS.native else "Python (extension not built)"
    print(f"op stream ({hints}), block-ops per CPU second; kvaware's loops: {loops}")
    print(table(["pages", "policy", "block-ops/s", "of lru", "hit rate"], rows))
    worst = {
        pol: min(rate[pol, n] / rate["lru", n] for n in sizes) for pol in policies if pol != "lru"
    }
    print(
        "worst ratio to LRU over the sizes: "
        + ", ".join(f"{pol} {r:.2f}" for pol, r in worst.items())
        + " (issue 17 target >= 0.5)"
    )
    write_json(
        args.json,
        {
            "hints": form,
            "kvaware_loops": "c" if LOOPS.native else "python",
            "rates": {f"{pol}@{n}": rate[pol, n] for pol, n in rate},
        },
        {f"{pol}_worst_of_lru": r for pol, r in worst.items()},
    )
    write_trace(args.trace)


if __name__ == "__main__":
    main()
