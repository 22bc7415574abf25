"""Prefetch: loading the pages of announced sequences before compute asks for them.

:meth:`~tierkv.store.KVStore.schedule` takes the sequences of the coming steps, the one about to
run first; their device-resident pages are marked as about to be used (the first due become the
most recent), then their absent pages are loaded in that order as far as the device holds them
without evicting an announced page. :meth:`~tierkv.store.KVStore.prefetch` loads given
sequences (or layers) now: best effort, wait, or wait with a timeout. Accuracy is counted when a
lease uses a prefetched page. A collaborator of :class:`~tierkv.store.KVStore`, built by it
with what it needs (no mixin): the live sequences, the tier core and the admission (both read
when used: they exist while the store is open), the counters and a task spawner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from tierkv.admission import Admission
from tierkv.errors import TierFullError, UnknownPageError
from tierkv.failures import Background
from tierkv.runtime import Priority
from tierkv.sequence import SequenceState
from tierkv.spec import KVSpec
from tierkv.stats import StoreCounters
from tierkv.tier_names import DEVICE
from tierkv.tiers import TierSet
from tierkv.timeline import Timeline

__all__ = ["Prefetcher"]


class Prefetcher:
    """Prefetch and schedule for one store."""

    def __init__(
        self,
        spec: KVSpec,
        seqs: Mapping[str, SequenceState],
        tiers: Callable[[], TierSet],
        admission: Callable[[], Admission],
        spawn: Callable[[Coroutine[Any, Any, Any], Background], asyncio.Task[Any]],
        counters: StoreCounters,
        timeline: Timeline,
        *,
        window: int,
        timeout: float,
    ) -> None:
        self.spec = spec
        self._seqs = seqs
        self._tiers = tiers
        self._admission = admission
        self._spawn = spawn
        self.counters = counters
        self.timeline = timeline
        self.prefetch_window = window
        self.timeout = timeout
        self._prefetched: set[bytes] = set()

    @property
    def tiers(self) -> TierSet:
        """The store's tier core (raises StoreClosedError when closed)."""
        return self._tiers()

    @property
    def admission(self) -> Admission:
        """The store's admission of leases."""
        return self._admission()

    def forget(self, keys: Iterable[bytes]) -> None:
        """Pages that will never be used (released): no longer counted as prefetched."""
        self._prefetched.difference_update(keys)

    def rename(self, old: Sequence[bytes], new: Sequence[bytes]) -> None:
        """Pages were renamed (:meth:`tierkv.ownership.Ownership.rekey`): a prefetched page
        stays prefetched under its new key."""
        pf = self._prefetched
        if pf:
            for o, n in zip(old, new):
                if o in pf:
                    pf.discard(o)
                    pf.add(n)

    def used(self, keys: Sequence[bytes]) -> None:
        """A lease pinned ``keys``: compute reads them now (prefetch accounting)."""
        pf = self._prefetched
        if pf:
            hit = [k for k in keys if k in pf]
            self.counters.prefetch_used += len(hit)
            pf.difference_update(hit)

    async def prefetch(
        self,
        seq_ids: Sequence[str],
        layers: Sequence[int] | None = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Load these sequences' pages to the device ahead of use; returns pages loaded.

        ``wait=False`` (best effort) returns at once and loads in the background;
        ``wait=True`` waits until they are loaded, at most ``timeout`` seconds (then the loads
        go on in the background and the call returns what had finished: possibly 0).
        """
        what = Background("prefetch", DEVICE)
        task = self._spawn(self._prefetch(list(seq_ids), layers, what), what)
        if not wait:
            await asyncio.sleep(0)  # let the loads be submitted before the caller computes
            return 0
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout or self.timeout)
        except TimeoutError:
            return 0

    async def _prefetch(
        self, seq_ids: list[str], layers: Sequence[int] | None, what: Background
    ) -> int:
        keys = what.keys  # named in the report if this task fails
        for s in seq_ids:
            seq = self._seqs.get(s)
            if seq is not None:
                keys += seq.all_pages(None if layers is None else list(layers))
        return await self._load_ahead(self.tiers.room.device_room(keys, set(keys)))

    async def _load_ahead(self, absent: list[bytes]) -> int:
        if not absent:
            return 0
        tiers = self.tiers
        absent = [k for k in absent if tiers.holds(k)]  # a page may have been renamed meanwhile
        if self.admission.waiting:  # leases wait for room: a prefetch never takes it first
            self.counters.prefetch_skipped += len(absent)
            return 0
        t0 = time.perf_counter()
        try:  # no wait for room: pins of leases go when they end, not when a prefetch needs it
            await tiers.acquire_device(absent, Priority.PREFETCH, wait_room=False)
        except (TierFullError, UnknownPageError):  # best effort: things changed meanwhile
            self.counters.prefetch_skipped += len(absent)
            return 0
        tiers.unpin_device(absent)
        self.timeline.span("prefetch", "transfer", t0, time.perf_counter(), pages=len(absent))
        self._prefetched.update(absent)
        self.counters.prefetched += len(absent)
        return len(absent)

    def schedule(self, steps: Sequence[Sequence[str]]) -> None:
        """Announce the sequences of the coming steps, the step about to run first.

        The pages of the first ``prefetch_window`` steps are prefetched in that order, as far as
        the device holds them without evicting an announced sequence's page (best effort).
        """
        ahead = [s for step in steps[: self.prefetch_window] for s in step if s in self._seqs]
        order = list(dict.fromkeys(ahead))
        if not order:
            return
        tiers = self.tiers
        table = tiers.table
        tiers.announce(k for s in order for k in self._seqs[s].all_pages())
        # announced pages count as about to be used: the ones due first become the most recent,
        # so that loads evict pages nobody announced before any announced one
        for s in reversed(order):
            tiers.pages.touch_device(self._seqs[s].all_pages())
        # walk the announced sequences in order while the device holds them all
        budget = table.capacity(DEVICE) - len(steps[0]) * self.spec.num_layers * 2  # new pages
        room: list[bytes] = []
        for s in order:
            pages = self._seqs[s].all_pages()
            if len(pages) > budget:
                break
            budget -= len(pages)
            ready = set(table.readable(pages, DEVICE))
            room += [k for k in pages if k not in ready]
        if room:
            self._spawn(self._load_ahead(room), Background("prefetch", DEVICE, room))
