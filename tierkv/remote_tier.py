"""A store's remote tier: pages leaving the host go to a `PageSource`; missing ones come back.

::

    KVStore(remote=src)     eviction: host victims (content pages) --offer--> Pusher --> src[0]
                               moves[host, remote]: gather into staging rows, published later
                            add_sequence / fetch_prefix: blocks missing locally
                               src.lookup -> reserve host slots -> moves[remote, host] -> commit

The remote tier is a `Tier` of the chain (`StoreRemote`: medium ``remote``, content pages
only), its moves handlers of the core's `Moves` registered when it attaches
(:func:`register_moves`): host -> remote (:func:`tierkv.push.push_move`: the batch's checksums
go with the staged pages to the source) and remote -> host (:func:`import_move`: a source's
read as an async engine job, filling the batch's `PageCheck` with the checksums it verified).
Its slots on this side are the push's staging rows (reserve / commit / abort / free); what a
source holds needs I/O to learn (`PageSource.lookup`), asked by :meth:`StoreRemote.fetch`.

Part of the core: it knows a remote tier only by the `PageSource` protocol
(:mod:`tierkv.page_source`), never the clients or the page server of :mod:`tierkv.remote`, so
the store imports it directly and the remote package depends on the store one way only.
Imported pages land in the host tier as unowned cached pages, two-phase (WRITING until the
source confirmed them), exactly as `import_prefix` does: `RemoteGlue.import_host`
(``tiers.glue``) reserves them and runs the source's read as a job of the transfer engine.
Every call on a source is bounded by the store's timeout; a failing source is counted
(``errors``) and skipped, never raised: any exception a source raises (a hostile server's
malformed answer included) is a counted miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.failures import FailureLog
from tierkv.keys import is_content
from tierkv.page_source import PageSource, load_checked, tier_label
from tierkv.page_sums import PageCheck
from tierkv.push import Pusher, push_move
from tierkv.runtime import Priority, TransferEngine, TransferHandle
from tierkv.tier import Batch, Holds, Moves
from tierkv.tier_names import HOST, REMOTE
from tierkv.tiers import TierSet

__all__ = ["Reader", "RemoteCounters", "StoreRemote", "import_move", "register_moves"]

#: The remote end of an import: one source's read of ``keys`` into host rows ``slots`` of the
#: array, reporting the checksums it verified in the `PageCheck`; returns the pages delivered.
Reader = Callable[[list[bytes], npt.NDArray[np.uint8], list[int], PageCheck], Awaitable[int]]


def import_move(engine: TransferEngine, read: Reader, batch: Batch) -> TransferHandle:
    """The move remote -> host: ``read`` of the batch's pages into its host slots, as an async
    job of the engine (the slots are the job's until it ends); the job's result is the pages
    delivered (the first ones), their verified checksums in ``batch.check``."""
    keys, arena, slots = list(batch.keys), batch.arena, [int(s) for s in batch.slots]
    check = batch.check if batch.check is not None else PageCheck()

    def start() -> Awaitable[int]:
        return read(keys, arena.array, slots, check)

    return engine.submit_async(arena, [], arena, slots, start, priority=Priority.PREFETCH)


def register_moves(moves: Moves) -> None:
    """Register the host -> remote push (staging) and the remote -> host import."""
    moves.register(HOST, REMOTE, push_move)
    moves.register(REMOTE, HOST, import_move)


@dataclass(slots=True)
class RemoteCounters:
    """Monotonic counters of the reads of a store's remote tier."""

    hits: int = 0  # pages imported intact
    misses: int = 0  # pages a source announced (lookup) but did not deliver (load)
    lookups: int = 0
    bytes_in: int = 0
    errors: int = 0  # failed lookups / loads
    last_error: str = ""


class StoreRemote:
    """The remote side of one store, a `Tier` of its chain: a pusher to the first source,
    reads from all of them.

    Args:
        sources: page sources, consulted in order for reads; pushes go to the first.
        write: push pages leaving the host tier (else read only).
        timeout: bound of every call on a source.
        push_pages / push_batch / push_wait: staging size, batch size, and the longest an
            eviction waits for staging room (see :class:`~tierkv.push.Pusher`).
    """

    def __init__(
        self,
        sources: Sequence[PageSource],
        page_bytes: int,
        *,
        write: bool = True,
        timeout: float = 5.0,
        push_pages: int = 256,
        push_batch: int = 64,
        push_wait: float = 0.05,
    ) -> None:
        if not sources:
            raise InvalidInputError("a remote tier needs at least one page source")
        for s in sources:
            if not isinstance(s, PageSource):
                raise InvalidTypeError(
                    f"{type(s).__name__} is not a PageSource (lookup/load/publish)"
                )
        self.sources = list(sources)
        self.page_bytes = page_bytes
        self.timeout = timeout
        self.counters = RemoteCounters()
        self.pusher: Pusher | None = None
        if write:
            self.pusher = Pusher(
                self.sources[0],
                page_bytes,
                capacity=push_pages,
                batch=push_batch,
                wait=push_wait,
                timeout=timeout,
            )
        self._tiers: TierSet | None = None
        self._failures = FailureLog("tierkv.remote")

    medium = REMOTE
    holds = Holds.CONTENT

    def attach(self, tiers: TierSet) -> None:
        """Hook into an opened store's tiers: the remote's moves join the core's registry, the
        tier joins its chain, evictions offer their pages."""
        register_moves(tiers.moves)
        tiers.chain.append(self)
        self._tiers = tiers
        if self.pusher is not None:
            self.pusher.start(tiers.glue)  # each gather and publish: a job of the engine
            tiers.glue.set_remote_offer(self._offer)

    async def aclose(self, flush: float = 0.0) -> None:
        """Stop pushing (staged pages get ``flush`` seconds to go out)."""
        if self._tiers is not None:
            self._tiers.glue.set_remote_offer(None)
        if self.pusher is not None:
            await self.pusher.aclose(flush)

    async def flush(self, timeout: float) -> bool:
        """Wait (bounded) until the pages staged for the remote went out; True if none left."""
        return True if self.pusher is None else await self.pusher.flush(timeout)

    # -- the Tier interface: this side's slots are the push's staging rows -----------------
    def accepts(self, key: bytes) -> bool:
        """Content pages only (a private page means nothing to another process)."""
        return self.holds.accepts(key)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is staged here for a push (no I/O: what the sources hold is
        asked by `fetch`, one lookup call per source)."""
        return self.pusher.held(keys) if self.pusher is not None else [False] * len(keys)

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Every page offered (no admission filter)."""
        return [True] * len(keys)

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Staging rows for a push (none for a read-only remote): `Pusher.reserve`."""
        return self.pusher.reserve(keys) if self.pusher is not None else []

    def commit(self, reserved: Sequence[Any], ok: Sequence[bool]) -> None:
        """Queue the rows written for publishing, return the others: `Pusher.commit`."""
        if self.pusher is not None:
            self.pusher.commit(reserved, ok)

    def abort(self, reserved: Sequence[Any]) -> None:
        """Return reserved staging rows unused."""
        if self.pusher is not None:
            self.pusher.abort(reserved)

    def free(self, keys: Sequence[bytes]) -> int:
        """Drop staged pages not yet published (a source's pages are its own)."""
        return self.pusher.drop(keys) if self.pusher is not None else 0

    def make_room(self, n: int) -> int:
        """Drop the oldest staged pages until ``n`` staging rows are free."""
        return self.pusher.shed(n) if self.pusher is not None else 0

    def close(self) -> None:
        """Nothing to release here: the sources are the caller's, the pusher stops at
        `aclose` (idempotent)."""

    async def _offer(self, victims: list[tuple[bytes, int]]) -> None:
        assert self._tiers is not None and self.pusher is not None
        content = [(k, s) for k, s in victims if is_content(k)]
        if content:
            keys, slots = [k for k, _ in content], [s for _, s in content]
            sums = self._tiers.glue.host_sums(keys, slots)  # as the page table knows them
            await self.pusher.offer(keys, self._tiers.glue.host_array, slots, sums)

    def _fail(self, kind: str, exc: BaseException, keys: Sequence[bytes]) -> None:
        self.counters.errors += 1
        self.counters.last_error = self._failures.report(kind, exc, tier="remote", keys=keys)

    # -- reads ---------------------------------------------------------------------------
    async def fetch(self, pages: list[bytes], layers: int) -> int:
        """Import the pages of ``pages`` (block-major, ``layers`` per block) that no local tier
        holds, from the sources in turn, as many leading blocks as the host tier has room for;
        returns the pages imported. Never raises a source's
        error (counted); raises StoreClosedError when the store closed meanwhile."""
        tiers = self._tiers
        assert tiers is not None
        table = tiers.table
        have = table.lookup(pages) // layers * layers
        got = 0
        for source in self.sources:
            if have >= len(pages):
                break
            try:
                self.counters.lookups += 1
                n = await asyncio.wait_for(source.lookup(pages[have:]), self.timeout)
                if type(n) is not int:
                    raise InvalidInputError(f"lookup answered {type(n).__name__}, not an int")
            except Exception as exc:  # a source's failure is a miss, whatever its type
                self._fail("remote lookup", exc, pages[have:])
                continue
            # an import is all or nothing: ask for what the host tier can take (free and
            # evictable slots), so a prefix longer than the host imports its leading blocks
            top = tiers.top  # the host tier (the leased tier of a host-first store)
            room = table.capacity(top) - table.used(top) + table.evictable(top)
            n = min(n, len(pages) - have, room) // layers * layers
            if n <= 0:
                continue
            # room is made sparing the prefix held locally (its other blocks)
            loaded = await self._import(tiers, source, pages[have : have + n], frozenset(pages))
            got += loaded
            have = table.lookup(pages) // layers * layers
        return got

    async def _read(
        self,
        source: PageSource,
        new: list[bytes],
        host: npt.NDArray[np.uint8],
        slots: list[int],
        check: PageCheck,
    ) -> int:
        """One source's read into host rows, bounded by the store's timeout: a `Reader` (the
        remote end of `import_move`). A failing source is a counted miss, whatever it raised."""
        try:
            read = load_checked(source, new, host, slots, check)
            ok = await asyncio.wait_for(read, self.timeout)
            if type(ok) is not int:
                raise InvalidInputError(f"load answered {type(ok).__name__}, not an int")
        except Exception as exc:  # a source's failure is a miss, whatever its type
            self._fail("remote load", exc, new)
            ok = 0
        got = max(0, min(ok, len(new)))
        self.counters.misses += len(new) - got
        return got

    async def _import(
        self, tiers: TierSet, source: PageSource, keys: list[bytes], keep: frozenset[bytes]
    ) -> int:
        check = PageCheck()  # the source's verdict on the pages' checksums
        move = tiers.moves.get(REMOTE, tiers.glue.host_medium)
        read = partial(self._read, source)

        def job(new: list[bytes], slots: list[int]) -> TransferHandle:
            return move(tiers.engine, read, Batch(new, tiers.glue.host_arena, slots, check=check))

        # victims compressed / pushed for room, not just dropped; nothing stays WRITING
        ok = await tiers.glue.import_host(
            keys,
            job=job,
            timeout=self.timeout + 1.0,
            check=check,
            tier=tier_label(source),
            keep=keep,
        )
        self.counters.hits += ok
        self.counters.bytes_in += ok * self.page_bytes
        return ok

    def stats(self) -> dict[str, Any]:
        """Reads and pushes of the remote tier."""
        c = self.counters
        out: dict[str, Any] = {
            "sources": len(self.sources),
            "hits": c.hits,
            "misses": c.misses,
            "lookups": c.lookups,
            "bytes_in": c.bytes_in,
            "errors": c.errors,
            "last_error": c.last_error,
        }
        p = self.pusher.counters if self.pusher is not None else None
        out["pushes"] = p.pushed if p else 0
        out["push_offered"] = p.offered if p else 0
        out["push_dropped"] = p.dropped if p else 0
        out["push_batches"] = p.batches if p else 0
        out["push_errors"] = p.errors if p else 0
        out["bytes_out"] = (p.pushed if p else 0) * self.page_bytes
        if p and p.last_error:
            out["last_push_error"] = p.last_error
        return out
