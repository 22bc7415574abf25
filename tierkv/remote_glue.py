"""The remote glue of the tier core: the host tier as the remote tier, the page server and the
lower chain see it.

Imports into host slots (a peer's load, a lower tier's read move: two-phase, each page
committed only once it arrived verified), exports of pinned host pages, the moves out of the
host tier (``move_out``: the remote push's staging gather, a handler of the core's `Moves`)
and the push's publish calls (:class:`~tierkv.push.Pusher` imports this class and calls it: no
callables threaded through), reservations and pins of host slots for the page server, the
listeners and offers of pages leaving the host (:class:`~tierkv.departures.Departures`), and
the checksums of pages crossing the process boundary. Every byte moved is a job of the
transfer engine. Part of the tier core (:class:`tierkv.tiers.TierSet`), built from its
:class:`~tierkv.core_context.CoreContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

import numpy as np
import numpy.typing as npt

from tierkv import page_sums
from tierkv.core_context import CoreContext
from tierkv.departures import Offer
from tierkv.errors import InvalidInputError, PageStateError, StoreTimeoutError, TierFullError
from tierkv.jobs import job_done, when_done, within
from tierkv.keys import PageKey
from tierkv.lower_tiers import ColdStorage
from tierkv.page_sums import NO_SUM, PageCheck, row_sums
from tierkv.page_table import StoreAllocation
from tierkv.runtime import Arena, Priority, TransferError, TransferHandle
from tierkv.tier import Batch
from tierkv.tier_names import HOST

__all__ = ["HostJob", "HostLoad", "RemoteGlue"]

# a remote read into host slots: (keys, the host arena's bytes, slots) -> pages delivered
HostLoad = Callable[[list[PageKey], npt.NDArray[np.uint8], list[int]], Awaitable[int]]
# a lower tier's read into host slots, queued as an engine job: (keys, slots) -> its handle,
# whose result is a hit per key (tierkv.tier: the move registered from that tier to the host)
HostJob = Callable[[list[PageKey], list[int]], TransferHandle]


class RemoteGlue:
    """The host tier of one tier core, for the remote tier, the page server and the chain."""

    def __init__(self, ctx: CoreContext, cold: ColdStorage) -> None:
        self._ctx = ctx
        self._table = ctx.table
        self._arenas = ctx.arenas  # the core's: replace_host_arena swaps its host entry
        self._engine = ctx.engine
        self._cold = cold
        # the host tier; with none, the leased tier (host-first: pinned host memory too)
        self._top = ctx.top

    def _deadline(self, timeout: float | None) -> float:
        return self._ctx.changes.deadline(self._engine.timeout if timeout is None else timeout)

    def _job(
        self,
        reads: Sequence[int],
        writes: Sequence[int],
        start: Callable[[], Awaitable[int]],
        priority: Priority,
    ) -> TransferHandle:
        """An async job of the engine that reads host slots ``reads`` out to a peer or writes
        ``writes`` from one (the slots are the job's until it has ended)."""
        host = self._arenas[self._top]
        return self._engine.submit_async(host, reads, host, writes, start, priority=priority)

    def _nowhere(self, keys: list[PageKey]) -> list[PageKey]:
        """The keys no tier holds, in order."""
        held = set(self._table.held(keys))
        return [k for k in keys if k not in held]

    def set_sums(self, keys: Sequence[PageKey], sums: Sequence[int]) -> None:
        """Record the checksums of pages whose bytes were verified on arrival (a peer's)."""
        self._table.sums.set(keys, sums)

    def host_sums(self, keys: Sequence[PageKey], slots: Sequence[int]) -> list[int]:
        """The checksums of host pages ``keys`` (at ``slots``, pinned by the caller) about to
        leave this process: the recorded ones, and for pages without one (sealed on a CUDA
        device, or imported before checksums) the CRC-32C of the host row, recorded now. Empty
        when checksums are off."""
        if not page_sums.enabled():
            return []
        sums = self._table.sums.get(keys)
        missing = [i for i, c in enumerate(sums) if c == NO_SUM]
        if missing:
            got = row_sums(self._arenas[self._top].array, [slots[i] for i in missing])
            for i, c in zip(missing, got):
                sums[i] = c
            self._table.sums.set([keys[i] for i in missing], got)
        return sums

    def count_corrupt(self, tier: str, n: int) -> None:
        """``n`` pages read from ``tier`` failed their checksum (dropped, never served)."""
        if n > 0:
            self._ctx.stats.corrupt[tier] = self._ctx.stats.corrupt.get(tier, 0) + n

    def _imported(
        self, keys: Sequence[PageKey], slots: Sequence[int], check: PageCheck | None, tier: str
    ) -> None:
        """Record the checksums of pages imported into host ``slots``: the ones the source
        verified, else (a source that does not check) computed from the bytes as they landed."""
        if check is not None:
            self.count_corrupt(tier, check.corrupt)
        if not keys or not page_sums.enabled():
            return
        sums = check.sums[: len(keys)] if check is not None else []
        if len(sums) < len(keys):
            sums = row_sums(self._arenas[self._top].array, slots)
        self._table.sums.set(keys, sums)

    @property
    def host_array(self) -> npt.NDArray[np.uint8]:
        """The host arena's bytes, ``[slots, page_bytes]`` (what transports register)."""
        return self._arenas[self._top].array

    @property
    def host_medium(self) -> str:
        """The medium of the host tier (the leased tier's of a host-first store: host memory
        too), the key of the moves between it and the tiers below or the remote tier."""
        return self._ctx.medium(self._top)

    @property
    def host_arena(self) -> Arena:
        """The host tier's arena (its size and backend; its slots belong to this core)."""
        return self._arenas[self._top]

    def replace_host_arena(self, arena: Arena) -> None:
        """Put the host tier on other memory of the same shape (shared with peers). Raises
        PageStateError when the host tier holds pages, or the shape differs, or the store
        has no host tier (its leased tier's pages are views of their arena)."""
        if self._top != HOST:
            raise PageStateError("a store without a host tier has no host arena to replace")
        old = self._arenas[HOST]
        if self._table.used(HOST):
            raise PageStateError("the host arena can only be replaced while it holds no page")
        if (arena.slot_bytes, arena.num_slots) != (old.slot_bytes, old.num_slots):
            raise PageStateError(
                f"host arena of {arena.num_slots} x {arena.slot_bytes} B cannot replace "
                f"{old.num_slots} x {old.slot_bytes} B"
            )
        arena.hand_over()
        self._arenas[HOST] = arena

    def add_host_listener(self, listener: Callable[[list[PageKey]], None]) -> None:
        """Call ``listener(keys)`` whenever pages leave the host tier."""
        self._ctx.departures.listeners.append(listener)

    def remove_host_listener(self, listener: Callable[[list[PageKey]], None]) -> None:
        """Stop calling ``listener`` (no error when it is not registered)."""
        if listener in self._ctx.departures.listeners:
            self._ctx.departures.listeners.remove(listener)

    def set_spill(self, spill: Offer | None) -> None:
        """Give the pages leaving the host tier (exact bytes, pinned while awaited) to the
        tiers below it (`tierkv.chain.LowerChain.spill`), or stop (None)."""
        self._ctx.departures.spill = spill

    @property
    def spill(self) -> Offer | None:
        """The lower chain's spill, if one is set."""
        return self._ctx.departures.spill

    def set_remote_offer(self, offer: Offer | None) -> None:
        """The remote tier's offer of host pages about to leave (None: no remote tier)."""
        self._ctx.departures.offer = offer

    @property
    def remote_offer(self) -> Offer | None:
        """The remote tier's offer, if one is set."""
        return self._ctx.departures.offer

    def reserve_host(self, keys: Sequence[PageKey]) -> StoreAllocation | None:
        """Reserve host slots for new pages (WRITING) that a peer or a test writes; returns
        the allocation (``keys`` reserved, ``slots``, ``present``: already held), or None when
        the host is full of pinned pages. Pages evicted for room are announced. Commit with
        :meth:`commit_host`."""
        alloc = self._table.prepare_store(keys, self._top)
        if alloc is not None:
            self._ctx.departures.left(alloc.evicted)
        return alloc

    def commit_host(self, keys: Sequence[PageKey], ok: bool = True) -> None:
        """End a :meth:`reserve_host`: the pages are readable (``ok``) or rolled back."""
        if keys:
            self._table.complete_store(keys, self._top, ok=ok)
            self._ctx.progress()

    def rename_reserved_host(self, keys: Sequence[PageKey], new: Sequence[PageKey]) -> None:
        """Rename pages of a :meth:`reserve_host` that are still WRITING (same slots, still
        unreadable): the page server fences an expired reservation's slots this way. Raises
        UnknownPageError / PageStateError as ``PageTable.rekey``."""
        if keys:
            self._table.rekey(keys, new, self._top)

    def pin_host(self, keys: Sequence[PageKey]) -> list[int]:
        """Pin readable host pages (none can be evicted) and return their slots. Raises
        PageStateError / UnknownPageError (nothing pinned) when one is not readable."""
        return self._table.prepare_load(keys, self._top) if keys else []

    def unpin_host(self, keys: Sequence[PageKey]) -> None:
        """Drop pins taken by :meth:`pin_host`."""
        if keys:
            self._table.complete_load(keys, self._top)
            self._ctx.progress()

    async def import_host(
        self,
        keys: Sequence[PageKey],
        load: HostLoad | None = None,
        *,
        job: HostJob | None = None,
        timeout: float | None = None,
        make_room: bool = True,
        check: PageCheck | None = None,
        tier: str = "peer",
        keep: AbstractSet[PageKey] = frozenset(),
    ) -> int:
        """Bring pages no tier holds into the host tier from a remote peer: room is made (the
        victims offered, compressed or dropped; with ``make_room=False`` only what the policy
        drops by itself), slots reserved, ``load(keys, host bytes, slots)`` run as an async
        job of the transfer engine, and the first pages it delivered committed, the rest
        rolled back (also on error or cancellation). Returns the pages imported (0 when there
        is no room and ``make_room``). Raises TierFullError (``make_room=False`` and the host
        is full of pinned pages), what ``load`` raised (TransferError wraps it) or
        WaitTimeoutError after ``timeout`` (the engine's by default). ``check``: what ``load``
        reports of the pages' checksums (verified ones are recorded; the corrupt ones counted
        under ``tier``); without it the checksums are computed from the bytes that landed.
        ``job`` instead of ``load``: a lower tier's move, which queues its own engine job and
        reports a hit per key (each hit committed, each miss rolled back). ``keep``: pages the
        room is made without, unless nothing else can go (the rest of the caller's prefix)."""
        if (load is None) == (job is None):
            raise InvalidInputError("import_host takes a load or a job, not both or neither")
        want = self._nowhere(list(dict.fromkeys(keys)))
        if not want:
            return 0
        if make_room:
            await self._cold.make_room(len(want), keep or None)
            want = self._nowhere(want)
        alloc = self.reserve_host(want) if want else None
        if alloc is None and not make_room:
            raise TierFullError(f"host tier: no room to import {len(want)} pages")
        if alloc is None or not alloc.keys:
            return 0
        new, slots = cast(list[PageKey], list(alloc.keys)), list(alloc.slots)
        host = self._arenas[self._top]
        try:
            if job is not None:
                handle = job(new, slots)
            else:
                assert load is not None
                handle = self._job(
                    [], slots, lambda: load(new, host.array, slots), Priority.PREFETCH
                )
        except BaseException:  # nothing queued (the engine closed, a bad size): roll back
            self.commit_host(new, ok=False)
            raise

        def settle() -> None:
            hits = _hits(handle.result() if handle.exception() is None else 0, len(new))
            got = [i for i, h in enumerate(hits) if h]
            keep = [new[i] for i in got]
            self._imported(keep, [slots[i] for i in got], check, tier)
            self.commit_host(keep)
            self.commit_host([k for k, h in zip(new, hits, strict=True) if not h], ok=False)

        try:
            await within(self._deadline(timeout), job_done(handle), lambda: _late(len(new)))
        except BaseException:
            handle.cancel()
            when_done(handle, settle)
            raise
        settle()
        return sum(_hits(handle.result(), len(new)))

    async def move_out(self, dest: str, end: object, batch: Batch) -> object:
        """Run the move from the host tier to medium ``dest`` (the handler registered for the
        pair: one engine job reading the batch's host slots, such as the remote push's
        staging gather) and wait until it has ended: also when the caller is cancelled, so
        that the other end's buffers and the host slots are never reused while the job reads
        or writes them. Returns the job's result; raises what it raised (unwrapped)."""
        handle = self._ctx.moves.get(self.host_medium, dest)(self._engine, end, batch)
        waiter = asyncio.ensure_future(job_done(handle))
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if not handle.cancel():  # running: a gather of a few pages, let it end first
                with contextlib.suppress(BaseException):
                    await waiter
            raise
        except TransferError as exc:
            raise (exc.__cause__ or exc) from None
        return handle.result()

    async def run_remote(self, call: Callable[[], Awaitable[int]]) -> int:
        """Run a remote call that touches no host slot (it reads a buffer of the caller's: the
        push staging) as an async job of the transfer engine, to its end (``call`` bounds
        itself). Returns what it returned; raises what it raised (unwrapped)."""
        handle = self._job([], [], call, Priority.WRITEBACK)
        try:
            await job_done(handle)
        except TransferError as exc:
            raise (exc.__cause__ or exc) from None
        return cast(int, handle.result())

    async def export_host(
        self,
        keys: Sequence[PageKey],
        send: HostLoad,
        *,
        timeout: float | None = None,
    ) -> int:
        """Send readable host pages to a remote peer: pinned (never evicted or reused) while
        ``send(keys, host bytes, slots)`` runs as an async job of the transfer engine, then
        unpinned. Returns what ``send`` returned (the pages the peer stored). Raises what it
        raised (TransferError wraps it), WaitTimeoutError after ``timeout``."""
        keys = list(keys)
        if not keys:
            return 0
        slots = self.pin_host(keys)
        host = self._arenas[self._top]
        try:
            handle = self._job(slots, [], lambda: send(keys, host.array, slots), Priority.WRITEBACK)
        except BaseException:  # nothing queued (the engine closed): the pins go
            self.unpin_host(keys)
            raise
        try:
            await within(self._deadline(timeout), job_done(handle), lambda: _late(len(keys)))
        except BaseException:
            handle.cancel()
            when_done(handle, lambda: self.unpin_host(keys))
            raise
        self.unpin_host(keys)
        return cast(int, handle.result())


def _late(n: int) -> StoreTimeoutError:
    return StoreTimeoutError(f"a remote transfer of {n} pages did not end in time")


def _hits(got: object, n: int) -> list[bool]:
    """A load's answer as a hit per key: a count (the first ``got`` pages delivered) or a list
    of hits (a lower tier's move); anything else is no hit."""
    if type(got) is int:
        ok = max(0, min(got, n))
        return [True] * ok + [False] * (n - ok)
    if isinstance(got, list) and len(got) == n:
        return [h is True for h in got]
    return [False] * n
