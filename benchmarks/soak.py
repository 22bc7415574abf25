"""Soak: many concurrent sequences with random cancellations on small tiers, for minutes.

    python benchmarks/soak.py [--sequences 1000] [--seconds 120] [--cancel 0.05]
                              [--no-write-behind] [--json FILE] [--plot FILE.png] [--quick]

Each of ``--sequences`` workers loops: add a sequence (prompts share prefixes, ids are reused),
prefill it in a lease, decode a few tokens (a lease per step), read its KV back, release it.
Any call is cancelled at a random await with probability ``--cancel``. The KV of token ``i`` in
layer ``l`` is a function of the prompt prefix alone (as a model's is), so every read, cached
prefixes included, is checked bit for bit. A driver announces the coming steps and advances the
decode clock (prefetch, compression to the cold tier).

Reported (issue 13's targets): stuck pages (not readable once everything is released and
drained), leaked pins and pages (pinned, owned, private or doomed pages after releasing
everything), KV mismatches, calls over their deadline (longer than the store's timeout plus
one second: a hang), errors that are not tierkv errors, and the resident set size after warm-up
against the end (ratio; flat is 1.00). Typed errors (a lease that waited its whole timeout for
room) are counted, not failures. Nothing is asserted on time.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import parser, table, write_json
from tierkv import KVSpec, TierKVError
from tierkv.arena_tier import ArenaTier
from tierkv.keys import KeyKind, key_kind
from tierkv.page_table import PageState
from tierkv.runtime import new_event_loop
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PREFIXES = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], []]


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_BASE = torch.arange(1, 2 * SPEC.num_kv_heads * SPEC.head_dim + 1, dtype=torch.float64)


def kv_of(tokens: list[int], i: int, layer: int) -> torch.Tensor:
    """``[2, H, 1, D]``: the KV of token ``i`` in ``layer``, a function of ``tokens[: i + 1]``
    (computed, not cached: the benchmark itself must keep its memory flat)."""
    h = hashlib.blake2b(repr((tokens[: i + 1], layer)).encode(), digest_size=8).digest()
    seed = (int.from_bytes(h, "little") % 1_000_003 + 1) / 1_000_003
    x = torch.frac(_BASE * (seed * 97.31)) * 2.0 - 1.0  # exact: float64, then one rounding
    return x.to(torch.float32).view(2, SPEC.num_kv_heads, 1, SPEC.head_dim)


def expected(tokens: list[int], layer: int, start: int, end: int) -> torch.Tensor:
    return torch.cat([kv_of(tokens, i, layer) for i in range(start, end)], dim=2)


@dataclass
class Figures:
    cycles: int = 0
    leases: int = 0
    reads: int = 0
    cancelled: int = 0
    mismatches: int = 0
    over_deadline: int = 0
    typed_errors: int = 0
    untyped_errors: int = 0
    longest_call_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    rss: list[tuple[float, int]] = field(default_factory=list)


class Soak:
    def __init__(self, store: KVStore, args: Any, figs: Figures) -> None:
        self.store, self.args, self.f = store, args, figs
        self.stop = False
        self.limit = store.timeout + 1.0

    async def call(self, rng: random.Random, coro: Any) -> bool:
        """Run ``coro``, cancelled at a random await with probability --cancel; returns
        whether it completed. Times it against the deadline; counts its errors."""
        t0 = time.monotonic()
        task = asyncio.ensure_future(coro)
        try:
            if rng.random() < self.args.cancel:
                for _ in range(rng.randrange(12)):
                    if task.done():
                        break
                    await asyncio.sleep(0)
                task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), self.limit * 2)
            except TimeoutError:
                task.cancel()
                raise
            return True
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the worker itself was cancelled
            self.f.cancelled += 1
            return False
        except TimeoutError:
            self.f.over_deadline += 1
            return False
        except TierKVError as exc:
            self.f.typed_errors += 1
            self.f.errors[type(exc).__name__] = self.f.errors.get(type(exc).__name__, 0) + 1
            return False
        except Exception as exc:  # counted: the store must raise tierkv errors only
            self.f.untyped_errors += 1
            name = f"untyped {type(exc).__name__}: {exc}"[:120]
            self.f.errors[name] = self.f.errors.get(name, 0) + 1
            return False
        finally:
            took = time.monotonic() - t0
            self.f.longest_call_s = max(self.f.longest_call_s, took)
            if took > self.limit:
                self.f.over_deadline += 1

    async def lease_step(self, sid: str, tokens: list[int], read: bool) -> None:
        """Bring every layer of ``sid`` to ``len(tokens)`` tokens; optionally read back."""
        store = self.store
        seq = store.sequence(sid)
        async with store.lease([sid]) as lease:
            self.f.leases += 1
            for layer in range(SPEC.num_layers):
                start = seq.kv_len[layer]
                if start < len(tokens):
                    ref = expected(tokens, layer, start, len(tokens))
                    await lease.append(sid, layer, ref[0], ref[1])
            if read:
                self.f.reads += 1
                for layer in range(SPEC.num_layers):
                    k, v = lease.kv(sid, layer)
                    want = expected(tokens, layer, 0, seq.kv_len[layer])
                    if not (torch.equal(k, want[0]) and torch.equal(v, want[1])):
                        self.f.mismatches += 1

    async def worker(self, i: int) -> None:
        rng = random.Random(i)
        store = self.store
        sid = f"w{i}"
        while not self.stop:
            tokens = rng.choice(PREFIXES) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            added = await self.call(rng, store.add_sequence(sid, tokens))
            if not added and not store.has_sequence(sid):
                continue
            await self.call(rng, self.lease_step(sid, tokens, read=rng.random() < 0.5))
            for _ in range(rng.randrange(1, 6)):
                if self.stop:
                    break
                tokens.append(rng.randrange(50))
                store.add_tokens(sid, tokens[-1:])
                await self.call(rng, self.lease_step(sid, tokens, read=rng.random() < 0.25))
            await self.call(rng, self.lease_step(sid, tokens, read=True))
            while store.has_sequence(sid):  # a cancelled release is retried
                await self.call(rng, store.release(sid))
            self.f.cycles += 1

    async def driver(self) -> None:
        """Announces the coming steps and advances the decode clock."""
        rng = random.Random(-1)
        store = self.store
        while not self.stop:
            live = store.sequence_ids()
            if live:
                store.schedule([[s] for s in rng.sample(live, min(4, len(live)))])
            store.step()
            await asyncio.sleep(0.005)


def tier_bytes(store: KVStore, high: dict[str, int]) -> int:
    """Bytes of the most slots each tier has used so far (what its arena has committed)."""
    slot = {t.name: t.arena.slot_bytes for t in store.tiers.chain if isinstance(t, ArenaTier)}
    return sum(n * slot[t] for t, n in high.items())


def leftovers(store: KVStore) -> dict[str, int]:
    """What remains after every sequence was released and background work drained."""
    tiers = store.tiers
    table = tiers.table
    out = {"stuck_pages": 0, "pinned_pages": 0, "private_pages": 0}
    for t in table.tier_names:
        for k in table.keys(t):
            out["stuck_pages"] += table.state(k, t) != PageState.READABLE
            out["pinned_pages"] += table.pins(k, t) > 0
            out["private_pages"] += key_kind(k[:16]) is KeyKind.PRIVATE
    out["owned_pages"] = len(tiers.ownership.owners) + len(tiers.ownership.owner_pins)
    out["doomed_pages"] = len(tiers.ownership.doomed)
    out["admitted_leases"] = store.admission.active + store.admission.waiting
    return out


async def soak(args: Any) -> dict[str, Any]:
    figs = Figures()
    async with KVStore(
        SPEC,
        device_bytes=args.device_pages * SPEC.page_bytes,
        host_bytes=args.host_pages * SPEC.page_bytes,
        codec="none",  # lossless: every read is checked bit for bit
        cold_fraction=0.25,
        compress_after=3,
        write_behind=not args.no_write_behind,
        timeout=args.timeout,
    ) as store:
        s = Soak(store, args, figs)
        workers = [asyncio.ensure_future(s.worker(i)) for i in range(args.sequences)]
        driver = asyncio.ensure_future(s.driver())
        t0 = time.monotonic()
        warm = t0 + min(args.seconds * 0.25, 30.0)
        rss_warm = 0
        next_line = t0
        high = {t: 0 for t in store.tiers.table.tier_names}  # most slots ever used per tier
        high_warm = 0
        while (now := time.monotonic()) < t0 + args.seconds:
            for t in high:
                high[t] = max(high[t], store.tiers.table.used(t))
            if not rss_warm and now >= warm:
                gc.collect()
                rss_warm = rss_bytes()
                high_warm = tier_bytes(store, high)
            if now >= next_line:
                figs.rss.append((now - t0, rss_bytes()))
                info = store.tiers.info()
                print(
                    f"\r{now - t0:6.0f}/{args.seconds:.0f} s  cycles {figs.cycles:,}  "
                    f"leases {figs.leases:,}  cancelled {figs.cancelled:,}  "
                    f"mismatches {figs.mismatches}  over deadline {figs.over_deadline}  "
                    f"errors {figs.typed_errors}+{figs.untyped_errors}  "
                    f"device {info['device']['used']}/{info['device']['capacity']}  "
                    f"RSS {rss_bytes() / 2**20:,.0f} MiB",
                    end="",
                    flush=True,
                )
                next_line = now + 5.0
            await asyncio.sleep(0.25)
        s.stop = True
        _, pending = await asyncio.wait(workers, timeout=store.timeout * 3)
        figs.over_deadline += len(pending)  # a worker that does not end is a hang
        for w in pending:
            w.cancel()
        driver.cancel()
        await asyncio.gather(*workers, driver, return_exceptions=True)
        for sid in store.sequence_ids():  # (a worker cancelled above may leave one)
            await store.release(sid)
        await asyncio.wait_for(store.drain(), store.timeout * 2)
        for _ in range(10):
            await asyncio.sleep(0.01)
        store.check()
        gc.collect()
        rss_end = rss_bytes()
        high_end = tier_bytes(store, high)
        print()
        left = leftovers(store)
        stats = store.stats()
    return {
        "sequences": args.sequences,
        "seconds": args.seconds,
        "write_behind": not args.no_write_behind,
        "cancel_probability": args.cancel,
        "device_pages": args.device_pages,
        "host_pages": args.host_pages,
        "cycles": figs.cycles,
        "leases": figs.leases,
        "kv_reads_checked": figs.reads,
        "cancelled_calls": figs.cancelled,
        "kv_mismatches": figs.mismatches,
        "calls_over_deadline": figs.over_deadline,
        "longest_call_s": figs.longest_call_s,
        "typed_errors": figs.typed_errors,
        "untyped_errors": figs.untyped_errors,
        "errors": figs.errors,
        **left,
        "rss_after_warmup_mib": rss_warm / 2**20,
        "rss_end_mib": rss_end / 2**20,
        "rss_end_over_warmup": rss_end / rss_warm if rss_warm else float("nan"),
        # tier arenas commit a slot's memory when it is first used and keep it: a cache that
        # fills its tiers after the warm-up grows RSS by that much (docs/store.md)
        "tier_memory_growth_mib": (high_end - high_warm) / 2**20,
        "rss_end_over_warmup_net_of_tier_growth": (rss_end - (high_end - high_warm)) / rss_warm
        if rss_warm
        else float("nan"),
        "written_back": stats["written_back"],
        "compressed": stats["compressed"],
        "page_loads": stats["page_loads"],
        "rss_series": figs.rss,
    }


def plot(res: dict[str, Any], path: str) -> None:
    """RSS over the run (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [t for t, _ in res["rss_series"]]
    ys = [r / 2**20 for _, r in res["rss_series"]]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(xs, ys)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"soak: {res['sequences']} sequences, {res['cycles']:,} cycles")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sequences", type=int, default=1000, help="concurrent sequences")
    p.add_argument("--seconds", type=float, default=120.0, help="duration of the run")
    p.add_argument("--cancel", type=float, default=0.05, help="probability to cancel a call")
    p.add_argument("--timeout", type=float, default=20.0, help="the store's timeout")
    p.add_argument("--device-pages", type=int, default=512)
    p.add_argument("--host-pages", type=int, default=16384)
    p.add_argument("--no-write-behind", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="draw RSS over the run (needs matplotlib)")
    args = p.parse_args()
    if args.quick:
        args.sequences, args.seconds = min(args.sequences, 100), min(args.seconds, 10.0)
    loop = new_event_loop()
    try:
        res = loop.run_until_complete(soak(args))
    finally:
        loop.close()
    targets = [
        ["stuck pages", res["stuck_pages"], 0],
        ["pinned pages after release", res["pinned_pages"], 0],
        [
            "private / owned / doomed pages left",
            res["private_pages"] + res["owned_pages"] + res["doomed_pages"],
            0,
        ],
        ["KV mismatches", res["kv_mismatches"], 0],
        ["calls over their deadline", res["calls_over_deadline"], 0],
        ["untyped errors", res["untyped_errors"], 0],
        ["RSS end / after warm-up", round(res["rss_end_over_warmup"], 3), "<= 1.05"],
        [
            "the same, net of tier slots first used after warm-up",
            round(res["rss_end_over_warmup_net_of_tier_growth"], 3),
            "<= 1.05",
        ],
    ]
    print(table(["figure", "value", "target"], targets))
    print(
        f"{res['cycles']:,} sequence cycles, {res['leases']:,} leases, "
        f"{res['kv_reads_checked']:,} reads checked, {res['cancelled_calls']:,} calls cancelled, "
        f"{res['typed_errors']:,} typed errors {res['errors'] or ''}; longest call "
        f"{res['longest_call_s']:.2f} s"
    )
    ratios = {
        "rss_end_over_warmup": res["rss_end_over_warmup"],
        "rss_end_over_warmup_net_of_tier_growth": res["rss_end_over_warmup_net_of_tier_growth"],
    }
    write_json(args.json, {k: v for k, v in res.items() if k != "rss_series"}, ratios)
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
