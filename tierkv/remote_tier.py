"""A store's remote tier: pages leaving the host go to a `PageSource`; missing ones come back.

::

    KVStore(remote=src)     eviction: host victims (content pages) --offer--> Pusher --> src[0]
                            add_sequence / fetch_prefix: blocks missing locally
                               src.lookup -> reserve host slots -> src.load -> commit

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.failures import FailureLog
from tierkv.keys import is_content
from tierkv.page_source import PageSource, load_checked, tier_label
from tierkv.page_sums import PageCheck
from tierkv.push import Pusher
from tierkv.tiers import TierSet

__all__ = ["RemoteCounters", "StoreRemote"]


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
    """The remote side of one store: a pusher to the first source, reads from all of them.

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

    def attach(self, tiers: TierSet) -> None:
        """Hook into an opened store's tiers (evictions offer their pages)."""
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

    async def _import(
        self, tiers: TierSet, source: PageSource, keys: list[bytes], keep: frozenset[bytes]
    ) -> int:
        check = PageCheck()  # the source's verdict on the pages' checksums

        async def load(new: list[bytes], host: npt.NDArray[np.uint8], slots: list[int]) -> int:
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

        # victims compressed / pushed for room, not just dropped; nothing stays WRITING
        ok = await tiers.glue.import_host(
            keys, load, timeout=self.timeout + 1.0, check=check, tier=tier_label(source), keep=keep
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
