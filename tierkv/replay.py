"""Trace replay: prefix hit rates of eviction policies on real request traces.

A trace is a list of requests, each a list of prefix block ids (the Mooncake format: one JSON
object per line with ``hash_ids``; equal ids at the same position are a reusable prefix block).
Replay semantics (those of the trace's README): requests in order; a request's hits are the
longest leading run of its blocks that is resident; then its resident blocks are touched in
order and its missing blocks inserted in order (a request's own blocks are never victims while
it is inserted). Hit rate = hits / all blocks.

Every policy runs through the real :class:`~tierkv.page_table.PageTable`. Two bounds frame the
figures: the infinite-capacity hit rate and Belady's offline optimum (evict the block whose next
use is furthest away; a block that would be the furthest is not admitted).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from tierkv.errors import InvalidInputError
from tierkv.page_table import PageTable
from tierkv.policies import DEFAULT_POLICY, PageHint
from tierkv.progress import Progress

Trace = list[list[int]]
_TIER = "cache"


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Outcome of one replay."""

    policy: str
    capacity_blocks: int
    hits: int
    blocks: int
    requests: int
    policy_stats: dict[str, float] = field(default_factory=dict)
    """The policy's own counters at the end (``EvictionPolicy.stats``; empty for most)."""

    @property
    def hit_rate(self) -> float:
        """Block hits / all blocks."""
        return self.hits / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, object]:
        """Figures as a JSON-friendly dict."""
        return {**asdict(self), "hit_rate": self.hit_rate}


MAX_LINE = 1 << 24
"""The longest trace line read (characters; a record of a million-token prompt's hash ids is
well under it)."""


MAX_HASH_ID = 1 << 63
"""Block ids of a trace are below this (Mooncake's are small non-negative ints; the disk
replay keys a block by its id's bits: a negative or huge id would alias another)."""


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace: each line's ``hash_ids``.

    Raises:
        InvalidInputError (a ValueError): a line is not JSON, has no ``hash_ids`` list of
        integers in [0, :data:`MAX_HASH_ID`), or is longer than :data:`MAX_LINE` (with its
        number).
    """
    out: Trace = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(iter(partial(f.readline, MAX_LINE + 1), ""), 1):
            if len(line) > MAX_LINE:  # (/dev/zero: one endless line read into memory)
                raise InvalidInputError(f"{path}:{n}: a line over {MAX_LINE} characters")
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
                raise InvalidInputError(  # (RecursionError: a line nested past the limit)
                    f"{path}:{n}: not a trace record with hash_ids ({exc!s:.200})"
                ) from None
            if not isinstance(ids, list) or not all(
                type(i) is int and 0 <= i < MAX_HASH_ID for i in ids
            ):  # (true / false were the blocks 1 and 0; -1 and 2**127 - 1 one disk key)
                raise InvalidInputError(
                    f"{path}:{n}: hash_ids must be a list of integers in [0, 2**63)"
                )
            out.append(ids)
            if limit is not None and len(out) >= limit:
                break
    return out


def _progress(trace: Trace, label: str, show: bool) -> Progress:
    return Progress(len(trace), label, enabled=show)


def replay(
    trace: Trace, capacity_blocks: int, policy: str = DEFAULT_POLICY, *, progress: bool = False
) -> ReplayResult:
    """Replay ``trace`` through a one-tier page table of ``capacity_blocks`` pages."""
    table = PageTable({_TIER: capacity_blocks}, policy, record_events=False)
    lookup, prepare_load, complete_load = table.lookup, table.prepare_load, table.complete_load
    prepare_store, complete_store, touch = table.prepare_store, table.complete_store, table.touch
    present = table.present
    hits = blocks = 0
    with _progress(trace, f"replay {policy}", progress) as bar:
        for ids in trace:
            bar.update()
            n = len(ids)
            blocks += n
            if not n:
                continue
            h = lookup(ids, _TIER)
            hits += h
            if h:  # the hit prefix is read: pin, then unpin and record the use
                prefix = ids[:h]
                prepare_load(prefix, _TIER)
                complete_load(prefix, _TIER)
            if n > capacity_blocks:  # a request larger than the cache keeps its head
                ids = ids[:capacity_blocks]
                n = capacity_blocks
            others = present(ids[h:], _TIER)
            if others:
                touch(others, _TIER)
            hints = [PageHint(j, j == n - 1, h, ids[j - 1] if j else None, n) for j in range(n)]
            alloc = prepare_store(ids, _TIER, hints)
            if alloc is None:  # cannot happen in a one-tier replay: nothing stays pinned
                raise RuntimeError("page table refused a store with nothing pinned")
            complete_store(alloc.keys, _TIER)
    stats = table.policy(_TIER).stats()
    return ReplayResult(policy, capacity_blocks, hits, blocks, len(trace), stats)


def replay_infinite(trace: Trace) -> ReplayResult:
    """The hit rate with unbounded capacity: every reusable prefix block hits."""
    seen: set[int] = set()
    hits = blocks = 0
    for ids in trace:
        blocks += len(ids)
        for b in ids:
            if b not in seen:
                break
            hits += 1
        seen.update(ids)
    return ReplayResult("infinite", 0, hits, blocks, len(trace))


def replay_belady(trace: Trace, capacity_blocks: int, *, progress: bool = False) -> ReplayResult:
    """Belady's offline optimum: evict (or do not admit) the block used furthest in the future."""
    never = len(trace) + 1
    # next_use[i][j]: index of the next request that names trace[i][j] (or `never`)
    next_use: list[list[int]] = [[] for _ in trace]
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        row = trace[i]
        next_use[i] = [last.get(b, never) for b in row]
        for b in row:
            last[b] = i
    resident: dict[int, int] = {}  # block -> its next use (the heap may hold stale entries)
    heap: list[tuple[int, int]] = []  # (-next_use, block)
    hits = blocks = 0
    with _progress(trace, "replay belady", progress) as bar:
        for i, ids in enumerate(trace):
            bar.update()
            blocks += len(ids)
            for b in ids:
                if b not in resident:
                    break
                hits += 1
            current = set(ids)
            for b, nu in zip(ids, next_use[i]):
                if b in resident:
                    resident[b] = nu
                    heapq.heappush(heap, (-nu, b))
                    continue
                if nu == never:
                    continue
                if len(resident) >= capacity_blocks:
                    deferred: list[tuple[int, int]] = []
                    victim = None
                    while heap:
                        neg, v = heapq.heappop(heap)
                        if resident.get(v) != -neg:
                            continue  # stale
                        if v in current:
                            deferred.append((neg, v))
                            continue
                        victim = (neg, v)
                        break
                    for d in deferred:
                        heapq.heappush(heap, d)
                    if victim is None or -victim[0] <= nu:
                        if victim is not None:
                            heapq.heappush(heap, victim)
                        continue  # not admitted: every resident block is needed sooner
                    del resident[victim[1]]
                resident[b] = nu
                heapq.heappush(heap, (-nu, b))
    return ReplayResult("belady", capacity_blocks, hits, blocks, len(trace))


def sweep(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    progress: bool = False,
    runner: Callable[[Trace, int, str], ReplayResult] | None = None,
) -> dict[str, list[ReplayResult]]:
    """Hit rates of each policy (and ``"belady"``) at each capacity."""
    run = runner or (lambda t, c, p: replay(t, c, p, progress=progress))
    out: dict[str, list[ReplayResult]] = {p: [] for p in (*policies, "belady")}
    for cap in capacities:
        for p in policies:
            out[p].append(run(trace, cap, p))
        out["belady"].append(replay_belady(trace, cap, progress=progress))
    return out
