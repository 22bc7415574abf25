"""The page server's directory: which content pages its host tier holds, at which slot and
generation, and the leases peers hold on them.

A slot's generation is bumped whenever the slot may hold something else than what a reader was
told: a new page stored there, a write rolled back, a lease that expired (its pins are dropped,
so the slot may be reused at any time after). Served pages are pinned (``prepare_load``) for the
lease; a reader re-checks its pages at release and counts a page whose slot or generation
changed as a miss::

    acquire(keys) -> pin, slots, gens ... reader copies the slots ... release -> check, unpin
                                          expiry (ttl) / peer gone -> unpin, gen += 1
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Literal, cast

from tierkv import page_sums
from tierkv.keys import is_content
from tierkv.page_sums import NO_SUM, row_sums
from tierkv.page_table import PageState
from tierkv.remote.errors import RemoteFullError, RemoteProtocolError
from tierkv.tiers import HOST, TierSet

__all__ = ["Directory", "is_content"]


@dataclass(slots=True)
class _Lease:
    kind: Literal["read", "write"]
    owner: object
    keys: list[bytes]
    slots: list[int]
    gens: list[int]
    timer: asyncio.TimerHandle | None = field(default=None)


class Directory:
    """Leases and generations over one store's host tier. Used from the store's event loop."""

    def __init__(self, tiers: TierSet, *, lease_ttl: float) -> None:
        self.tiers = tiers
        self.lease_ttl = lease_ttl
        slots = tiers.table.capacity(HOST)
        self.gen = [0] * slots
        self._seen: list[bytes | None] = [None] * slots
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self.expired = 0

    def _observe(self, slot: int, key: bytes | None) -> int:
        if self._seen[slot] != key:
            self.gen[slot] += 1
            self._seen[slot] = key
        return self.gen[slot]

    def _readable(self, keys: list[bytes]) -> int:
        table = self.tiers.table
        n = 0
        for k in keys:
            if not is_content(k) or not table.lookup([k], HOST):
                break
            n += 1
        return n

    # -- reads ---------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """Length of the prefix of ``keys`` readable in the host tier (content pages only)."""
        return self._readable(keys)

    def acquire(
        self, keys: list[bytes], owner: object
    ) -> tuple[int, list[int], list[int], list[int]]:
        """Pin the readable prefix of ``keys`` for a reader; returns (lease, slots, gens,
        sums): the pages' checksums, what the reader checks its copy against."""
        n = self._readable(keys)
        pinned = keys[:n]
        slots = self.tiers.pin_host(pinned)
        gens = [self._observe(s, k) for s, k in zip(slots, pinned)]
        sums = self.tiers.host_sums(pinned, slots)
        return self._open(_Lease("read", owner, pinned, slots, gens)), slots, gens, sums

    def release(self, lease_id: int) -> int:
        """End a read lease; returns how many leading pages are still the ones served (a page
        whose slot or generation changed is a miss). An unknown (expired) lease: 0."""
        lease = self._leases.pop(lease_id, None)
        if lease is None or lease.kind != "read":
            return 0
        self._cancel_timer(lease)
        table = self.tiers.table
        valid = 0
        for k, s, g in zip(lease.keys, lease.slots, lease.gens):
            ok = (
                table.present([k], HOST)
                and table.slot(k, HOST) == s
                and table.state(k, HOST) == PageState.READABLE
                and self.gen[s] == g
            )
            if not ok:
                break
            valid += 1
        self.tiers.unpin_host(lease.keys)
        return valid

    # -- writes --------------------------------------------------------------------------
    def reserve(
        self, keys: list[bytes], owner: object, sums: list[int] | None = None
    ) -> tuple[int, list[int]]:
        """Reserve host slots for pages a peer will write; returns (lease, slot per key, -1
        where the page is already held or was not admitted). ``sums``: the checksum the peer
        declares for each key (recorded for the reserved pages, checked at :meth:`verify`).
        Raises RemoteFullError."""
        if not all(is_content(k) for k in keys):
            raise RemoteProtocolError("only content pages can be published")
        alloc = self.tiers.reserve_host(keys)  # pages evicted for room are announced
        if alloc is None:
            raise RemoteFullError(f"no room for {len(keys)} pages: the host tier is pinned")
        new = cast(list[bytes], alloc.keys)
        if sums is not None and new:  # (a reserved page is WRITING: it holds no checksum yet)
            declared = dict(zip(keys, sums))
            self.tiers.set_sums(new, [declared[k] for k in new])
        slot_of = dict(zip(new, alloc.slots))
        for k, s in slot_of.items():
            self._seen[s] = None
            self._observe(s, k)
        lease = _Lease("write", owner, new, list(alloc.slots), [])
        return self._open(lease), [slot_of.get(k, -1) for k in keys]

    def commit(self, lease_id: int, ok: bool) -> int:
        """Make reserved pages readable (``ok``) or roll them back; returns pages stored (0 for
        an expired lease, whose pages were rolled back)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None or lease.kind != "write":
            return 0
        self._cancel_timer(lease)
        self._end_write(lease, ok)
        return len(lease.keys) if ok else 0

    def verify(self, lease_id: int) -> int:
        """Check the bytes a peer wrote under a write lease against the checksums it declared
        at reserve, before :meth:`commit` publishes them: the pages that differ, or came
        without a checksum, are rolled back now (the others stay reserved); returns how many.
        Nothing to check (0) for an unknown lease, or with checksums off."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "write" or not lease.keys or not page_sums.enabled():
            return 0
        want = self.tiers.table.sums(lease.keys)
        got = row_sums(self.tiers.host_array, lease.slots)
        bad = [i for i, (w, g) in enumerate(zip(want, got)) if w == NO_SUM or w != g]
        if not bad:
            return 0
        drop = set(bad)
        self.tiers.commit_host([lease.keys[i] for i in bad], ok=False)
        for i in bad:
            self._observe(lease.slots[i], None)
        lease.keys[:] = [k for i, k in enumerate(lease.keys) if i not in drop]
        lease.slots[:] = [s for i, s in enumerate(lease.slots) if i not in drop]
        self.tiers.count_corrupt("peer", len(bad))
        return len(bad)

    def _end_write(self, lease: _Lease, ok: bool) -> None:
        if lease.keys:
            self.tiers.commit_host(lease.keys, ok=ok)
        if not ok:
            for s in lease.slots:
                self._observe(s, None)

    # -- expiry --------------------------------------------------------------------------
    def _open(self, lease: _Lease) -> int:
        lid = next(self._ids)
        self._leases[lid] = lease
        lease.timer = asyncio.get_running_loop().call_later(self.lease_ttl, self.expire, lid)
        return lid

    @staticmethod
    def _cancel_timer(lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()

    def expire(self, lease_id: int) -> None:
        """Drop a lease now: unpin (read; its slots' generations move on) or roll back."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        self._cancel_timer(lease)
        self.expired += 1
        if lease.kind == "write":
            self._end_write(lease, ok=False)
            return
        self.tiers.unpin_host(lease.keys)
        for s in lease.slots:
            self.gen[s] += 1  # unpinned: whoever still reads it may see the slot reused

    def expire_all(self, owner: object | None = None) -> int:
        """Expire every lease (of ``owner`` only, if given); returns how many."""
        ids = [i for i, le in self._leases.items() if owner is None or le.owner is owner]
        for i in ids:
            self.expire(i)
        return len(ids)

    @property
    def leases(self) -> int:
        """Leases held now."""
        return len(self._leases)

    def held(self) -> set[bytes]:
        """Every readable content page of the host tier (what the peers are told)."""
        table = self.tiers.table
        keys = table.keys(HOST)
        return {k for k in keys if is_content(k) and table.state(k, HOST) == PageState.READABLE}

    def entries(self) -> dict[bytes, tuple[int, int]]:
        """Every readable content page of the host tier -> (slot, generation)."""
        table = self.tiers.table
        out: dict[bytes, tuple[int, int]] = {}
        for k in table.keys(HOST):
            if is_content(k) and table.state(k, HOST) == PageState.READABLE:
                s = table.slot(k, HOST)
                out[k] = (s, self._observe(s, k))
        return out
