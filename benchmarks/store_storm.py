"""Store storm: four workers on one small store, every call cancelled at a random await.

    python benchmarks/store_storm.py [--ops 100000] [--round-ops 4000] [--workers 4]
                                     [--cancel 0.25] [--seed 0] [--no-write-behind]
                                     [--json FILE] [--quick]

Issue 23's scenario: ``--workers`` tasks drive one :class:`~tierkv.store.KVStore` (2 layers,
4-token pages, a host tier of 160 pages, a lossless cold pool, write-behind on) with adds
(prompts sharing prefixes, so full blocks are published and reused), leases that append 1-8
tokens to every layer and read every layer back, releases, prefetches and schedules; each call
is cancelled with probability ``--cancel`` after a random number of loop turns. The KV of token
``i`` in layer ``l`` is a function of the prompt prefix ``tokens[: i + 1]`` alone (as a model's
is), so every read, reused prefixes included, is checked bit for bit. The run is cut into
rounds of ``--round-ops`` operations, each on a fresh store seeded ``seed + round``; after each
round every sequence is released, the store drained and its invariants checked.

Reported (issue 23's targets, each 0): wrong K/V (leases that read back bytes other than the
model's for tokens the store says it holds), lost live pages (a live sequence's page in no
tier: ``UnknownPageError``), internal errors reaching callers (anything but the typed errors a
caller must expect under load: ``TierFullError``, ``StoreTimeoutError``), and invariant
failures. Nothing is asserted on time.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import parser, table, write_json
from benchmarks.soak import SPEC, expected  # KV that is a function of the prefix alone
from tierkv import SequenceError, StoreTimeoutError, TierFullError, UnknownPageError
from tierkv.runtime import new_event_loop
from tierkv.store import KVStore

PREFIXES = [[5] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [1, 2, 3, 4], []]
MAX_LIVE = 8  # live sequences (x 10 blocks x 2 layers: the host tier holds them all)
EXPECTED = (TierFullError, StoreTimeoutError, SequenceError)  # a caller must handle these


@dataclass
class Figures:
    """What a run counted."""

    ops: int = 0
    rounds: int = 0
    cancelled: int = 0
    reads_checked: int = 0
    wrong_kv: int = 0
    lost_live_pages: int = 0
    internal_errors: int = 0
    invariant_failures: int = 0
    expected_errors: int = 0
    bad_rounds: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    first_wrong: list[str] = field(default_factory=list)

    def count(self, name: str) -> None:
        name = re.sub(r"[0-9a-f]{32,}", "<page>", re.sub(r"'s[0-9]+'", "<seq>", name))[:110]
        self.errors[name] = self.errors.get(name, 0) + 1


class Round:
    """One round: ``workers`` tasks, ``ops`` operations in all, on ``store``."""

    def __init__(self, store: KVStore, seed: int, ops: int, cancel: float, f: Figures) -> None:
        self.store, self.seed, self.left, self.cancel, self.f = store, seed, ops, cancel, f
        self.tokens: dict[str, list[int]] = {}  # the model: live sequences' token ids
        self.busy: set[str] = set()  # sequences a worker leases or releases now
        self.next_id = 0
        self.appending: dict[str, asyncio.Lock] = {}

    async def call(self, rng: random.Random, aw: Awaitable[Any], what: str) -> bool:
        """Run ``aw``, cancelled after a random number of loop turns with probability
        ``cancel``; returns whether it completed. Counts its errors."""
        task = asyncio.ensure_future(aw)
        try:
            if rng.random() < self.cancel:
                for _ in range(rng.randrange(16)):
                    if task.done():
                        break
                    await asyncio.sleep(0)
                task.cancel()
            await task
            return True
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            self.f.cancelled += 1
            return False
        except EXPECTED as exc:
            self.f.expected_errors += 1
            self.f.count(f"{what}: {type(exc).__name__}: {exc}")
            return False
        except UnknownPageError as exc:
            self.f.lost_live_pages += 1
            self.f.count(f"{what}: {type(exc).__name__}: {exc}")
            return False
        except Exception as exc:  # an internal error reached the caller
            self.f.internal_errors += 1
            self.f.count(f"{what}: {type(exc).__name__}: {exc}")
            return False

    def pick(self, rng: random.Random) -> str | None:
        free = [s for s in self.tokens if s not in self.busy]
        return rng.choice(free) if free else None

    async def lease(self, sid: str, tokens: list[int], rng: random.Random) -> None:
        """Append 1-8 tokens' KV to every layer (in a random layer order), read all back."""
        store = self.store
        seq = store.sequence(sid)
        async with store.lease([sid]) as lease:
            layers = list(range(SPEC.num_layers))
            rng.shuffle(layers)
            for layer in layers:
                # one append to a sequence at a time (as a server steps it): the KV passed is
                # that of the tokens from the length the store has when the append runs
                async with self.appending.setdefault(sid, asyncio.Lock()):
                    start = seq.kv_len_of(layer)
                    if start < len(tokens):
                        ref = expected(tokens, layer, start, len(tokens))
                        await lease.append(sid, layer, ref[0], ref[1])
            self.check(lease, sid, seq, tokens)

    def check(self, lease: Any, sid: str, seq: Any, tokens: list[int]) -> None:
        if not self.store.is_live(seq):
            return  # released meanwhile (by another worker)
        for layer in range(SPEC.num_layers):
            n = seq.kv_len_of(layer)
            k, v = lease.kv(sid, layer)
            self.f.reads_checked += 1
            if n == 0:
                continue
            want = expected(tokens, layer, 0, n)
            if not (torch.equal(k, want[0]) and torch.equal(v, want[1])):
                bad = [
                    i
                    for i in range(n)
                    if not torch.equal(k[:, i], want[0][:, i])
                    or not torch.equal(v[:, i], want[1][:, i])
                ]
                self.f.wrong_kv += 1
                if len(self.f.first_wrong) < 10:
                    self.f.first_wrong.append(
                        f"round {self.seed} {sid} layer {layer} tokens {bad} of {n}"
                    )

    async def worker(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        store = self.store
        while self.left > 0:
            self.left -= 1
            self.f.ops += 1
            op = rng.random()
            if len(self.tokens) > MAX_LIVE:  # a server admits so many: release one
                op = 0.7
            if op < 0.2 or len(self.tokens) < 2:  # add
                sid = f"s{self.next_id}"
                self.next_id += 1
                toks = rng.choice(PREFIXES) + [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
                self.busy.add(sid)
                try:
                    await self.call(rng, store.add_sequence(sid, toks), "add")
                    if store.has_sequence(sid):
                        self.tokens[sid] = toks
                finally:
                    self.busy.discard(sid)
            elif op < 0.65:  # lease: grow, append, read back (two may lease one sequence)
                sid = rng.choice(sorted(self.tokens))
                if sid in self.busy:
                    continue
                toks = self.tokens[sid]
                new = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
                if len(toks) + len(new) <= 40:
                    store.add_tokens(sid, new)
                    toks += new
                await self.call(rng, self.lease(sid, toks, rng), "lease")
            elif op < 0.77:  # release
                sid = self.pick(rng)
                if sid is None:
                    continue
                self.busy.add(sid)
                try:
                    await self.call(rng, store.release(sid), "release")
                    if not store.has_sequence(sid):
                        del self.tokens[sid]
                finally:
                    self.busy.discard(sid)
            elif op < 0.88:  # prefetch
                ids = rng.sample(sorted(self.tokens), min(len(self.tokens), rng.randrange(1, 4)))
                aw = store.prefetch(ids, wait=rng.random() < 0.5, timeout=2.0)
                await self.call(rng, aw, "prefetch")
            else:  # schedule the next steps and advance the clock
                live = sorted(self.tokens)
                store.schedule([[s] for s in rng.sample(live, min(len(live), 3))])
                store.step()
                await asyncio.sleep(0)

    async def run(self, workers: int) -> None:
        await asyncio.gather(*(self.worker(i) for i in range(workers)))
        store = self.store
        for sid in store.sequence_ids():
            await store.release(sid)
        await store.drain()
        try:
            store.check()
        except AssertionError as exc:
            self.f.invariant_failures += 1
            self.f.count(f"check: {exc}")


async def one_round(args: Any, seed: int, ops: int, f: Figures) -> None:
    page = SPEC.page_bytes
    cold_fraction = 0.25
    host_bytes = int(160 * page / (1 - cold_fraction)) + page  # a host tier of 160 pages
    store = KVStore(
        SPEC,
        device_bytes=args.device_pages * page,
        host_bytes=host_bytes,
        codec="none",  # lossless: every read is checked bit for bit
        cold_fraction=cold_fraction,
        compress_after=2,
        write_behind=not args.no_write_behind,
        timeout=args.timeout,
    )
    async with store:
        before = (f.wrong_kv, f.lost_live_pages, f.internal_errors, f.invariant_failures)
        await Round(store, seed, ops, args.cancel, f).run(args.workers)
        if (f.wrong_kv, f.lost_live_pages, f.internal_errors, f.invariant_failures) != before:
            f.bad_rounds.append(seed)
    f.rounds += 1


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--ops", type=int, default=100_000, help="operations in all")
    p.add_argument("--round-ops", type=int, default=4000, help="operations per fresh store")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cancel", type=float, default=0.25, help="probability to cancel a call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-pages", type=int, default=32)
    p.add_argument("--timeout", type=float, default=5.0, help="the store's timeout")
    p.add_argument("--no-write-behind", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.ops = min(args.ops, 8000)
    f = Figures()
    loop = new_event_loop()
    t0 = time.monotonic()
    try:
        seed = args.seed
        while f.ops < args.ops:
            loop.run_until_complete(one_round(args, seed, min(args.round_ops, args.ops - f.ops), f))
            seed += 1
            print(
                f"\r{f.ops:,} ops, {f.rounds} rounds, {time.monotonic() - t0:.0f} s: wrong K/V "
                f"{f.wrong_kv}, lost live pages {f.lost_live_pages}, internal errors "
                f"{f.internal_errors}, invariants {f.invariant_failures}",
                end="",
                flush=True,
            )
    finally:
        loop.close()
    print()
    rows = [
        ["wrong K/V reads", f.wrong_kv, 0],
        ["lost live pages", f.lost_live_pages, 0],
        ["internal errors reaching callers", f.internal_errors, 0],
        ["invariant failures after a round", f.invariant_failures, 0],
    ]
    print(table(["figure", "value", "target"], rows))
    print(
        f"{f.ops:,} operations in {f.rounds} rounds ({time.monotonic() - t0:.0f} s), "
        f"{f.reads_checked:,} layer reads checked, {f.cancelled:,} calls cancelled, "
        f"{f.expected_errors:,} expected typed errors; write-behind "
        f"{'off' if args.no_write_behind else 'on'}"
    )
    for line in f.first_wrong:
        print("  wrong:", line)
    for name, n in sorted(f.errors.items(), key=lambda x: -x[1])[:20]:
        print(f"  {n:6d}  {name}")
    if f.bad_rounds:
        print("  rounds with failures (seeds):", f.bad_rounds[:20])
    res = {
        "ops": f.ops,
        "rounds": f.rounds,
        "write_behind": not args.no_write_behind,
        "cancel_probability": args.cancel,
        "reads_checked": f.reads_checked,
        "cancelled_calls": f.cancelled,
        "wrong_kv": f.wrong_kv,
        "lost_live_pages": f.lost_live_pages,
        "internal_errors": f.internal_errors,
        "invariant_failures": f.invariant_failures,
        "expected_errors": f.expected_errors,
        "errors": f.errors,
        "bad_rounds": f.bad_rounds,
    }
    write_json(args.json, res, {})
    sys.exit(1 if f.wrong_kv or f.lost_live_pages or f.internal_errors else 0)


if __name__ == "__main__":
    main()
