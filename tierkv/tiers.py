"""The tier core of a store: placement of pages on the device and the moves between tiers.

Three tiers, each an arena of fixed-size slots plus its column of the page table::

    device  (GPU memory; host memory on the cpu backend)     slots of page_bytes  <- attention
       |  ^  evict: write back if dirty or no lower copy      |  load (demand / prefetch)
       v  |                                                   |
    host    (pinned host RAM)                                 slots of page_bytes
       |  ^  full or idle: compress                           |  load: decode into device slot
       v  |                                                   |
    cold    (host RAM, compressed by a codec)                 slots of encoded_bytes  -> dropped

Every move between two media is a handler of one `Moves` registry (:mod:`tierkv.tier`), looked
up by (source medium, destination medium): device <-> host copies, host -> cold encode, cold ->
device / host decode (and, below the host, the lower chain's: :mod:`tierkv.chain`).

Rules that keep KV safe:

* a page that a live sequence owns always has a copy somewhere: its lower copies are pinned while
  it is owned, and a device page is written back before it leaves when it is dirty (newer than
  its lower copies) or has no lower copy;
* a slot that a transfer reads or writes is never reused before the transfer has finished: the
  pages are WRITING / MOVING / pinned in the page table until a task owned by the core (not the
  caller, who may be cancelled) has seen the copy complete.

One owner: :class:`TierSet` alone holds the page table and the arenas (the arenas hand their
slots over to it, ``Arena.hand_over``: the page table's free lists are the one record of slots,
its page states the one record of what is in flight, its pins the one record of pins). It
places pages on the device (reserve, load, pin, wait for room) and builds one class per other
concern, each from one :class:`~tierkv.core_context.CoreContext`:

==========================================  =================================================
``tiers.ownership`` (:mod:`.ownership`)      owners, doomed pages, renames (one place, every
                                             per-page record told)
``tiers.pages`` (:mod:`.lease_pages`)        a lease's views and writes of device pages
``tiers.glue`` (:mod:`.remote_glue`)         the host tier for the remote tier, page server, chain
``tiers.cold`` (:mod:`.lower_tiers`)         host room, compression, the codec's moves
:mod:`.eviction` (``DeviceEviction``)        room on the device, write-back, write-behind
:mod:`.prefault` (``Prefaulter``)            the thread committing device memory ahead of use
==========================================  =================================================

Everything else (leases, prefetch, the remote tier, the page server, metrics) uses those
public methods and reads through :attr:`TierSet.table`, a read-only view; every transition is
checked by :meth:`TierSet.check`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any, cast

from tierkv.arena_tier import core_tiers
from tierkv.codecs import Codec
from tierkv.core_context import CoreContext
from tierkv.departures import Departures
from tierkv.device_loads import DeviceLoads
from tierkv.device_room import DeviceRoom
from tierkv.errors import (
    InvalidInputError,
    PageStateError,
    UnknownPageError,
)
from tierkv.eviction import DeviceEviction
from tierkv.keys import PageKey
from tierkv.lease_pages import LeasePages
from tierkv.lower_tiers import ColdStorage
from tierkv.owners import Owners
from tierkv.ownership import Ownership
from tierkv.page_table import PageState, PageTable
from tierkv.prefault import Prefaulter
from tierkv.remote_glue import HostJob, HostLoad, RemoteGlue
from tierkv.runtime import Arena, Backend, Priority, TransferEngine
from tierkv.spec import KVSpec
from tierkv.stats import TierStats
from tierkv.table_view import TableView
from tierkv.tenants import Tenants
from tierkv.tier import Moves, Tier, copy_move
from tierkv.tier_names import COLD, DEVICE, HOST
from tierkv.timeline import Timeline
from tierkv.waits import Changes

__all__ = ["COLD", "DEVICE", "HOST", "HostJob", "HostLoad", "TierSet", "TierStats"]


class TierSet:
    """The tier core of one store: arenas, page table, the moves between tiers, and the
    placement of pages on the device; its other concerns are the classes it builds (see the
    module docstring). Used from one event loop."""

    def __init__(
        self,
        spec: KVSpec,
        backend: Backend,
        engine: TransferEngine,
        *,
        device_pages: int,
        host_pages: int,
        cold_pages: int,
        codec: Codec | None,
        policy: str,
        timeline: Timeline | None = None,
        host_first: bool = False,
        tenants: Tenants | None = None,
    ) -> None:
        if host_pages <= 0 and cold_pages > 0 and not host_first:
            raise InvalidInputError("a cold tier under the device needs a host tier between")
        if host_first and host_pages > 0:
            raise InvalidInputError("host-first: the leased tier is the host tier (host_pages=0)")
        self._spec = spec
        self.engine = engine
        codec = codec if cold_pages > 0 else None
        kind = "pinned" if host_first else "device"  # host-first: leased pages in host RAM
        arenas: dict[str, Arena] = {
            DEVICE: backend.create_arena(DEVICE, spec.page_bytes, device_pages, kind=kind)
        }
        tiers = {DEVICE: device_pages}
        if host_pages > 0:  # (none: host-first, or a device alone; see tierkv.chain_config)
            arenas[HOST] = backend.create_arena(HOST, spec.page_bytes, host_pages, kind="pinned")
            tiers[HOST] = host_pages
        if codec is not None:
            arenas[COLD] = backend.create_arena(
                COLD, codec.encoded_bytes(spec), cold_pages, kind="pinned"
            )
            tiers[COLD] = cold_pages
        for arena in arenas.values():  # the page table alone hands out slots
            arena.hand_over()
        self._arenas = arenas
        # (the store keeps counters; cold copies are encoded: a checksum per cold slot)
        self._table = PageTable(
            tiers, policy, record_events=False, encoded=self._encoded(tiers), tenants=tenants
        )
        self._tenants = tenants  # the tenants' accounting (tierkv.tenants), or None
        self.table = TableView(self._table)
        self._lower = tuple(t for t in (HOST, COLD) if t in tiers)
        # the tier whose pages leave to the chain below and the remote tier: the host tier, or
        # with none the leased tier itself, whose owned pages the owners then pin (their one
        # exact copy: never a victim)
        self.top = HOST if HOST in tiers else DEVICE
        self.leased = HOST if host_first else DEVICE  # the leased tier's name, for the user
        self.stats = TierStats()
        # every change that may free device room or land a page in flight wakes the waiters:
        # in flight is the page state (WRITING / MOVING) alone, pins the page table's alone
        self.changes = Changes()
        # every move between two arenas of the core, looked up by (source, destination) medium;
        # a host-first store's leased column is in host memory: its medium is host
        media = {t: HOST if host_first and t == DEVICE else t for t in arenas}
        self.moves = Moves()
        if HOST in arenas:
            self.moves.register(HOST, DEVICE, copy_move)
            self.moves.register(DEVICE, HOST, copy_move)
        ctx = CoreContext(
            spec=spec,
            table=self._table,
            arenas=arenas,
            engine=engine,
            moves=self.moves,
            owners=Owners(self._table, self._lower if HOST in tiers else (DEVICE, *self._lower)),
            departures=Departures(),
            stats=self.stats,
            timeline=timeline if timeline is not None else Timeline(),
            progress=self.signal_progress,
            changes=self.changes,
            lower=self._lower,
            top=self.top,
            leased=self.leased,
            media=media,
        )
        self._timeline = ctx.timeline
        self.cold = ColdStorage(ctx, codec)  # registers the codec's moves
        self._evict = DeviceEviction(ctx, self.cold)
        self.ownership = Ownership(ctx, self._evict, self.cold)
        self.ownership.on_rename(self._evict.rename)  # the dirty set, the announced pages
        if tenants is not None:
            self.ownership.on_rename(tenants.rename)  # a page's charge follows it
        self.glue = RemoteGlue(ctx, self.cold)
        self.room = DeviceRoom(ctx, self._evict)
        self._device_lock = asyncio.Lock()
        self._reap_due = False  # a reap is scheduled for the next loop turn
        self._prefaulter = Prefaulter(arenas[DEVICE])
        self._loads = DeviceLoads(ctx, self._evict, self.cold, self._prefaulter, self._device_lock)
        self.pages = LeasePages(ctx, self._evict, self._loads)
        # the chain, fastest first, as Tier objects: the core's arenas, then the tiers attached
        # below (the lower chain's, the remote tier)
        self.chain: list[Tier] = list(core_tiers(ctx, self._evict.dirty))

    @staticmethod
    def _encoded(tiers: Mapping[str, int]) -> list[str]:
        return [COLD] if COLD in tiers else []

    # -- read-only state -------------------------------------------------------------------
    def holds(self, key: PageKey) -> bool:
        """True when some tier holds ``key`` (readable, or in flight to readable)."""
        return bool(self._table.tiers_of(key))

    # -- announcements -----------------------------------------------------------------
    def announce(self, keys: Iterable[PageKey]) -> None:
        """Pages the coming steps read, soonest needed first (the server's schedule): device
        evictions take them only when no other page can go, the last needed first, whatever
        the policy ranks (the schedule outranks it)."""
        self._evict.announce(keys)

    # -- waiting ---------------------------------------------------------------------------
    def signal_progress(self) -> None:
        """Device state changed (a copy ended, a pin went, a page left): wake whoever waits for
        room or for a page in flight, and reap the doomed pages that became idle.

        Reaping walks every doomed page, and a busy loop signals progress thousands of times a
        second while a hundred pages stay doomed (pinned by write-behind copies): so the reap
        runs once per loop turn, from a callback of its own, and wakes the waiters again if it
        freed something."""
        if self.ownership.reap_pending and not self._reap_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): reap now
                self.ownership.reap()
            else:
                self._reap_due = True
                loop.call_soon(self._reap_turn)
        self.changes.notify()

    def _reap_turn(self) -> None:
        self._reap_due = False
        if self.ownership.reap_turn():
            self.changes.notify()

    def _deadline(self, timeout: float | None = None) -> float:
        """Loop time ``timeout`` seconds from now (default: the engine's timeout)."""
        return self.changes.deadline(self.engine.timeout if timeout is None else timeout)

    # -- device allocation ---------------------------------------------------------------
    async def reserve_device(
        self, keys: Sequence[PageKey], *, mine: int = 0, timeout: float | None = None
    ) -> list[int]:
        """Reserve device slots for new pages (WRITING) and return them; the caller writes the
        bytes and calls :meth:`commit_device` (or :meth:`abort_device`). When other holders'
        pins fill the device it waits for them to go, at most ``timeout`` seconds (default the
        engine's); ``mine``: device pages the caller itself holds pinned (they never go).

        Raises:
            TierFullError: the pages never fit, or no room came before the deadline.
            PageStateError: a key is already on the device (nothing is reserved).
        """
        self.room.ensure_fits(len(keys))
        deadline = self._deadline(timeout)
        while True:
            async with self._device_lock:
                if self._table.present(keys, DEVICE):
                    raise PageStateError(f"{len(keys)} new pages: some are already on the device")
                if await self._evict.make_room(len(keys), deadline, keys):
                    got = self._loads.take_slots(keys)
                    if got is not None:
                        return got[1]
            if not self.room.could_free(mine):
                raise self.room.full_error(len(keys))
            waited = self.engine.timeout if timeout is None else timeout
            await self.changes.wait(deadline, partial(self.room.full_error, len(keys), waited))

    def commit_device(self, keys: Sequence[PageKey]) -> None:
        """New device pages are written: readable, dirty (no lower copy yet)."""
        self._table.complete_store(keys, DEVICE)
        self._evict.mark_dirty(keys)

    def abort_device(self, keys: Sequence[PageKey], *, pinned: bool, owned: bool) -> None:
        """Undo new pages reserved by :meth:`reserve_device` (WRITING), or committed and then
        ``pinned`` (:meth:`pin_device`) and ``owned`` (:meth:`own`): a failed append leaves no
        page, pin or owner behind."""
        if not keys:
            return
        table = self._table
        if owned:
            self.ownership.disown(keys)
        if pinned:
            table.complete_load(keys, DEVICE)
        writing = [k for k in keys if table.state(k, DEVICE) == PageState.WRITING]
        if writing:
            table.complete_store(writing, DEVICE, ok=False)
        rest = [k for k in keys if k not in set(writing)]
        self._evict.clean(keys)
        if rest:
            table.remove(rest, DEVICE)
        self.signal_progress()

    def pin_device(self, keys: Sequence[PageKey]) -> None:
        """Pin readable device pages (unpin with :meth:`unpin_device`)."""
        self._table.prepare_load(keys, DEVICE)

    async def acquire_device(
        self,
        keys: Sequence[PageKey],
        priority: Priority,
        *,
        wait_room: bool = True,
        timeout: float | None = None,
    ) -> int:
        """Make every page of ``keys`` readable on the device, loading what is not, and pin
        them there (release with :meth:`unpin_device`). Returns how many pages this call had
        to load or wait for (0 when all were resident: no wait).

        Pages in flight (being loaded or written back) are waited for; when other holders'
        pins leave no room, it waits for them to go (``wait_room=False``, as a prefetch: waits
        only for copies in flight, fails at once when leases' pins fill the device). Every wait
        is woken by a change and bounded by ``timeout`` (default the engine's).

        Raises:
            UnknownPageError: a page is in no tier.
            TierFullError: the pages can never be resident at once, or no room came before
                the deadline.
            StoreTimeoutError: pages in flight (a load, a write-back) did not land before it.
        On any error (or cancellation) no pin is left behind.
        """
        todo = list(dict.fromkeys(keys))
        self.room.ensure_fits(len(todo))
        deadline = self._deadline(timeout)
        table = self._table
        pinned: list[PageKey] = []
        waited = -1
        try:
            while True:
                ready, todo = cast(
                    tuple[list[PageKey], list[PageKey]], table.pin_readable(todo, DEVICE)
                )
                pinned += ready
                if waited < 0:
                    waited = len(todo)
                if not todo:
                    return waited
                missing = cast(list[PageKey], table.absent(todo, DEVICE))
                loadable = self._evict.with_lower(missing)
                if len(loadable) < len(missing):
                    held = set(table.held(missing))
                    for k in missing:
                        if k not in held:
                            raise UnknownPageError(f"page {k.hex()} is in no tier")
                if loadable:
                    got = await self._loads.load(loadable, priority, deadline)
                    if got is not None:
                        pinned += got
                        done = set(got)
                        todo = [k for k in todo if k not in done]
                        continue
                    if not self.room.could_free(len(pinned)):
                        raise self.room.full_error(len(loadable))
                    if not wait_room and not self.room.copies_in_flight():
                        raise self.room.full_error(len(loadable))  # only leases' pins: never wait
                # (partials, not closures: cells would be tracked objects for the whole wait)
                await self.changes.wait(deadline, partial(self.room.stuck, list(todo), timeout))
        except BaseException:
            if pinned:
                table.complete_load(pinned, DEVICE)
                self.signal_progress()
            raise

    def unpin_device(self, keys: Sequence[PageKey]) -> None:
        """Unpin pages pinned by :meth:`acquire_device` or :meth:`pin_device` (records their
        use) and wake whoever waits for room."""
        self._table.complete_load(list(dict.fromkeys(keys)), DEVICE)
        self.signal_progress()

    def close(self) -> None:
        """Stop the background thread (the prefault of the device arena). Idempotent."""
        self._prefaulter.close()

    def check(self) -> None:
        """Assert the invariants (for tests and debugging). Raises AssertionError.

        The page table's own; every owned page has a copy somewhere; owners' pins are recorded
        exactly on copies that exist; doomed pages are unowned and still somewhere; dirty pages
        are on the device.
        """
        table = self._table
        table.check()
        self.ownership.check()
        assert self._evict.write_behind_pinned >= 0, "write-behind pins went negative"
        for k in self._evict.dirty:
            assert table.present([k], DEVICE), f"dirty page {k.hex()} is not on the device"
        if self._tenants is not None:
            self._tenants.check(
                lambda t: [k for k in table.keys(t) if table.state(k, t) != PageState.MOVING]
            )

    def info(self) -> dict[str, Any]:
        """Pages per tier and capacities."""
        return {
            t: {"used": self._table.used(t), "capacity": self._table.capacity(t)}
            for t in self._table.tier_names
        }
