"""The page server's directory: which content pages its host tier holds, at which slot and
generation, and the leases peers hold on them.

A slot's generation is bumped whenever the slot may hold something else than what a reader was
told: a new page stored there, a write rolled back, a lease that expired (its pins are dropped,
so the slot may be reused at any time after). Served pages are pinned (``prepare_load``) for the
lease; a reader re-checks its pages at release and counts a page whose slot or generation
changed as a miss::

    acquire(keys) -> pin, slots, gens ... reader copies the slots ... release -> check, unpin
                                          expiry (ttl) / peer gone -> unpin, gen += 1

Writes are fenced: a peer writes its reserved slots one-sidedly, so a slot it may still be
writing is never handed to anyone else. While a write lease lives, only its writer (its
declared transport ``agent``) may write its slots (`may_write`, asked by the transports that
receive the bytes). A write lease that expires (ttl, its connection gone, the server closing)
is *fenced*: its pages are rolled back under their keys (anyone may publish them again) but
its slots stay WRITING under quarantine keys (never readable, never reused) until its write
has ended for certain: the writer commits or aborts it (told LeaseExpiredError), or every
transport has revoked the writer's access and drained what it had let in (``revoke``)::

    reserve -> live (writer may write its slots) -> commit -> readable / rolled back
                 | expiry
                 v
               fenced: keys free, slots quarantined -- late commit / abort (LeaseExpiredError)
                                                    -- revoke(agent) drained on every transport
                                                    -> slots free

With tenants (docs/security.md, *Tenants*), every lease carries the tenant of the session that
took it: a write lease's slots are writable only through that tenant's transports, and (when
reads are guarded) a slot is readable only through the transports of a tenant that holds a
live read lease on it. The keys themselves are the tenant's already (tenancy.py); the tenant
of each published page is kept for its counters only (``tenant_of``). The file stays whole
(~400 lines): one class whose leases, generations and guards share the same slots.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, cast

from tierkv import page_sums
from tierkv.keys import KEY_BYTES, is_content
from tierkv.page_sums import NO_SUM, row_sums
from tierkv.page_table import PageState
from tierkv.remote.errors import LeaseExpiredError, RemoteFullError, RemoteProtocolError
from tierkv.tenants import Tenants
from tierkv.tiers import TierSet

__all__ = ["Directory", "is_content"]


@dataclass(slots=True)
class _Lease:
    kind: Literal["read", "write"]
    owner: object
    keys: list[bytes]
    slots: list[int]
    gens: list[int]
    timer: asyncio.TimerHandle | None = field(default=None)
    agent: str | None = None  # the writer's transport agent (None: undeclared, any agent)
    tenant: str | None = None  # the tenant of the session that took it (None: the default)


#: revoke(agent) -> per transport, a future done once that writer's access is revoked and what
#: was let in has landed, or None where the transport cannot tell (the writer's word only)
Revoke = Callable[[str | None], list["asyncio.Future[None] | None"]]

#: quarantine keys: private keys (never served) under a prefix no hash-made key is likely to have
_QUARANTINE = bytes([0xFF]) + b"fence"


def _quarantine_key(n: int) -> bytes:
    return _QUARANTINE + n.to_bytes(KEY_BYTES - len(_QUARANTINE), "big")


class Directory:
    """Leases and generations over one store's host tier. Used from the store's event loop."""

    def __init__(
        self,
        tiers: TierSet,
        *,
        lease_ttl: float,
        revoke: Revoke | None = None,
        max_writing: int | None = None,
        guard_reads: bool = False,
        quotas: Tenants | None = None,
    ) -> None:
        """``revoke``: see `Revoke` (None: fenced slots wait for the writer's word);
        ``max_writing``: slots that live write leases and the quarantine may hold together
        (default: the whole host tier); past it `reserve` raises RemoteFullError;
        ``guard_reads``: keep which tenants read which slots, for `may_read` (tenants);
        ``quotas``: the store's tenants (:mod:`tierkv.tenants`): the pages a session of one
        of them reserves are charged to it, and its quotas decide the room they get."""
        self.tiers = tiers
        self.quotas = quotas
        self.lease_ttl = lease_ttl
        slots = tiers.table.capacity(tiers.top)  # the host tier's column
        self.gen = [0] * slots
        self._seen: list[bytes | None] = [None] * slots
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self.expired = 0
        self._revoke = revoke
        self.max_writing = slots if max_writing is None else max_writing
        self._writer: dict[int, _Lease] = {}  # slot -> the live write lease that owns it
        self._fenced: dict[int, _Lease] = {}  # lease id -> expired write lease in quarantine
        self._qids = itertools.count(1)
        self.quarantined = 0  # slots held by fenced leases
        self.fenced = 0  # write leases fenced so far
        self.late_commits = 0  # commits / aborts of fenced leases (the writer told)
        self._reading: dict[tuple[int, str | None], int] = {}  # (slot, tenant) -> read leases
        self._guard_reads = guard_reads
        self.tenant_of: dict[bytes, str] = {}
        """Pages published by a tenant's session -> the tenant, while in the host tier
        (counters only: access goes by the tenant's keys)."""

    def _observe(self, slot: int, key: bytes | None) -> int:
        if self._seen[slot] != key:
            self.gen[slot] += 1
            self._seen[slot] = key
        return self.gen[slot]

    def _readable(self, keys: list[bytes]) -> int:
        table = self.tiers.table
        n = 0
        for k in keys:
            if not is_content(k) or not table.lookup([k], self.tiers.top):
                break
            n += 1
        return n

    # -- reads ---------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """Length of the prefix of ``keys`` readable in the host tier (content pages only)."""
        return self._readable(keys)

    def acquire(
        self, keys: list[bytes], owner: object, tenant: str | None = None
    ) -> tuple[int, list[int], list[int], list[int]]:
        """Pin the readable prefix of ``keys`` for a reader (of ``tenant``); returns (lease,
        slots, gens, sums): the pages' checksums, what the reader checks its copy against."""
        n = self._readable(keys)
        pinned = keys[:n]
        slots = self.tiers.glue.pin_host(pinned)
        gens = [self._observe(s, k) for s, k in zip(slots, pinned)]
        sums = self.tiers.glue.host_sums(pinned, slots)
        if self._guard_reads:
            for s in slots:
                self._reading[s, tenant] = self._reading.get((s, tenant), 0) + 1
        lease = _Lease("read", owner, pinned, slots, gens, tenant=tenant)
        return self._open(lease), slots, gens, sums

    def may_read(self, tenant: str | None, first: int, last: int) -> bool:
        """True when every slot in ``[first, last]`` is held by a live read lease of
        ``tenant`` (the transports' read guard, on a server with tenants)."""
        return all(self._reading.get((s, tenant)) for s in range(first, last + 1))

    def _end_read(self, lease: _Lease) -> None:
        """A read lease ends: its pins and its slots' read guard go."""
        for s in lease.slots if self._guard_reads else ():
            left = self._reading.pop((s, lease.tenant), 0) - 1
            if left > 0:
                self._reading[s, lease.tenant] = left
        self.tiers.glue.unpin_host(lease.keys)

    def release(self, lease_id: int, owner: object) -> int:
        """End ``owner``'s read lease; returns how many leading pages are still the ones served
        (a page whose slot or generation changed is a miss). 0 and nothing changed for a lease
        that is not ``owner``'s live read lease (expired, unknown, another connection's, or a
        write lease: those end by commit)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "read" or lease.owner is not owner:
            return 0
        del self._leases[lease_id]
        self._cancel_timer(lease)
        table, host = self.tiers.table, self.tiers.top
        valid = 0
        for k, s, g in zip(lease.keys, lease.slots, lease.gens):
            ok = (
                table.present([k], host)
                and table.slot(k, host) == s
                and table.state(k, host) == PageState.READABLE
                and self.gen[s] == g
            )
            if not ok:
                break
            valid += 1
        self._end_read(lease)
        return valid

    # -- writes --------------------------------------------------------------------------
    def reserve(
        self,
        keys: list[bytes],
        owner: object,
        sums: list[int] | None = None,
        agent: str | None = None,
        tenant: str | None = None,
    ) -> tuple[int, list[int]]:
        """Reserve host slots for pages a peer (of ``tenant``) will write (only ``agent``'s
        writes through ``tenant``'s transports may land in them; agent None: any agent's);
        returns (lease, slot per key, -1 where the page is
        already held or was not admitted). ``sums``: the checksum the peer declares for each
        key (recorded for the reserved pages, checked at :meth:`verify`). Raises
        RemoteFullError (no room, or the slots being written and quarantined would pass
        ``max_writing``)."""
        if not all(is_content(k) for k in keys):
            raise RemoteProtocolError("only content pages can be published")
        busy = len(self._writer) + self.quarantined
        if busy + len(keys) > self.max_writing:
            raise RemoteFullError(
                f"no room for {len(keys)} pages: {len(self._writer)} slots are being written and "
                f"{self.quarantined} quarantined behind writes not known to have ended "
                f"(at most {self.max_writing})"
            )
        who = None if self.quotas is None or tenant is None else self.quotas.index.get(tenant)
        if who is not None and self.quotas is not None:  # (its maker: charged before stored)
            self.quotas.charge(keys, who, fresh=True)
        alloc = self.tiers.glue.reserve_host(keys)  # pages evicted for room are announced
        if alloc is None:
            blocked, refused = self.tiers.table.quota_refusal(self.tiers.top)
            if blocked:
                raise RemoteFullError(
                    f"no room for {len(keys)} pages within the tenants' quotas (for "
                    f"{refused or 'nobody'}: no page of a tenant at its reservation goes)"
                )
            raise RemoteFullError(f"no room for {len(keys)} pages: the host tier is pinned")
        new = cast(list[bytes], alloc.keys)
        if sums is not None and new:  # (a reserved page is WRITING: it holds no checksum yet)
            declared = dict(zip(keys, sums))
            self.tiers.glue.set_sums(new, [declared[k] for k in new])
        slot_of = dict(zip(new, alloc.slots))
        for k, s in slot_of.items():
            self._seen[s] = None
            self._observe(s, k)
        lease = _Lease("write", owner, new, list(alloc.slots), [], agent=agent, tenant=tenant)
        for s in lease.slots:
            self._writer[s] = lease
        return self._open(lease), [slot_of.get(k, -1) for k in keys]

    def may_write(self, agent: str, first: int, last: int, tenant: str | None = None) -> bool:
        """True when every slot in ``[first, last]`` belongs to a live write lease of
        ``tenant`` that ``agent`` may write (the transports' write guard)."""
        for s in range(first, last + 1):
            lease = self._writer.get(s)
            if lease is None or (lease.agent is not None and lease.agent != agent):
                return False
            if lease.tenant != tenant:
                return False
        return True

    def commit(self, lease_id: int, ok: bool, owner: object) -> int:
        """Make reserved pages readable (``ok``) or roll them back; returns pages stored.
        Raises LeaseExpiredError when ``owner`` holds no such live lease: it expired (its
        pages were rolled back; this commit ends its fence) or never was."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.kind == "write" and lease.owner is owner:
            del self._leases[lease_id]
            self._cancel_timer(lease)
            self._end_write(lease, ok)
            return len(lease.keys) if ok else 0
        fenced = self._fenced.get(lease_id)
        if fenced is not None and fenced.owner is owner:
            self.late_commits += 1
            self._unfence(lease_id)  # the writer's word: its write has ended
            raise LeaseExpiredError(
                f"write lease {lease_id} expired before its commit: its {len(fenced.keys)} pages "
                "were not stored (publish them again)"
            )
        raise LeaseExpiredError(f"no write lease {lease_id} on this connection (expired?)")

    def verify(self, lease_id: int, owner: object) -> int:
        """Check the bytes a peer wrote under a write lease against the checksums it declared
        at reserve, before :meth:`commit` publishes them: the pages that differ, or came
        without a checksum, are rolled back now (the others stay reserved); returns how many.
        Called with the commit (the writer's word that its writes ended), so the rolled-back
        slots leave the write guard at once. Nothing to check (0) for a lease that ``owner``
        does not hold live (commit then raises), or with checksums off."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "write" or lease.owner is not owner:
            return 0
        if not lease.keys or not page_sums.enabled():
            return 0
        want = self.tiers.table.sums(lease.keys)
        got = row_sums(self.tiers.glue.host_array, lease.slots)
        bad = [i for i, (w, g) in enumerate(zip(want, got)) if w == NO_SUM or w != g]
        if not bad:
            return 0
        drop = set(bad)
        self.tiers.glue.commit_host([lease.keys[i] for i in bad], ok=False)
        for i in bad:
            self._writer.pop(lease.slots[i], None)
            self._observe(lease.slots[i], None)
        lease.keys[:] = [k for i, k in enumerate(lease.keys) if i not in drop]
        lease.slots[:] = [s for i, s in enumerate(lease.slots) if i not in drop]
        self.tiers.glue.count_corrupt("peer", len(bad))
        return len(bad)

    def _end_write(self, lease: _Lease, ok: bool) -> None:
        for s in lease.slots:
            self._writer.pop(s, None)
        if lease.keys:
            self.tiers.glue.commit_host(lease.keys, ok=ok)
        if ok and lease.tenant is not None:
            self.tenant_of.update(dict.fromkeys(lease.keys, lease.tenant))
        if not ok:
            for s in lease.slots:
                self._observe(s, None)

    def _fence(self, lease_id: int, lease: _Lease) -> None:
        """An expired write lease: its pages roll back under their keys, its slots stay
        WRITING under quarantine keys until its write has ended for certain."""
        for s in lease.slots:
            self._writer.pop(s, None)  # from now on the guard refuses its writes
        if not lease.keys:
            return
        qkeys = [_quarantine_key(next(self._qids)) for _ in lease.keys]
        self.tiers.glue.rename_reserved_host(lease.keys, qkeys)
        if self.quotas is not None:  # the tenant charged stays charged till they go
            self.quotas.rename(lease.keys, qkeys)
        for s in lease.slots:
            self._observe(s, None)
        lease.keys = qkeys
        self._fenced[lease_id] = lease
        self.quarantined += len(lease.slots)
        self.fenced += 1
        drains = self._revoke(lease.agent) if self._revoke is not None else [None]
        if drains and all(d is not None for d in drains):
            done = asyncio.gather(*cast(list["asyncio.Future[None]"], drains))

            def drained(f: asyncio.Future[list[None]]) -> None:
                if not f.cancelled():
                    self._unfence(lease_id)

            done.add_done_callback(drained)

    def _unfence(self, lease_id: int) -> None:
        """The fenced lease's write has ended: its slots go free."""
        lease = self._fenced.pop(lease_id, None)
        if lease is None:
            return
        self.quarantined -= len(lease.slots)
        self.tiers.glue.commit_host(lease.keys, ok=False)
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
            self._fence(lease_id, lease)
            return
        self._end_read(lease)
        for s in lease.slots:
            self.gen[s] += 1  # unpinned: whoever still reads it may see the slot reused

    def expire_all(self, owner: object | None = None) -> int:
        """Expire every lease (of ``owner`` only, if given); returns how many."""
        ids = [i for i, le in self._leases.items() if owner is None or le.owner is owner]
        for i in ids:
            self.expire(i)
        return len(ids)

    def unfence_all(self) -> int:
        """Free every quarantined slot (the transports are closed: nothing lands any more);
        returns how many leases were fenced."""
        ids = list(self._fenced)
        for i in ids:
            self._unfence(i)
        return len(ids)

    @property
    def leases(self) -> int:
        """Leases held now."""
        return len(self._leases)

    def held(self) -> set[bytes]:
        """Every readable content page of the host tier (what the peers are told)."""
        table, host = self.tiers.table, self.tiers.top
        keys = table.keys(host)
        return {k for k in keys if is_content(k) and table.state(k, host) == PageState.READABLE}

    def left(self, keys: list[bytes]) -> None:
        """Pages left the host tier: they are no tenant's any more."""
        if self.tenant_of:
            for k in keys:
                self.tenant_of.pop(k, None)

    def tenant_pages(self) -> dict[str, int]:
        """Pages in the host tier per tenant that published them."""
        out: dict[str, int] = {}
        for tenant in self.tenant_of.values():
            out[tenant] = out.get(tenant, 0) + 1
        return out

    def entries(self) -> dict[bytes, tuple[int, int]]:
        """Every readable content page of the host tier -> (slot, generation)."""
        table, host = self.tiers.table, self.tiers.top
        out: dict[bytes, tuple[int, int]] = {}
        for k in table.keys(host):
            if is_content(k) and table.state(k, host) == PageState.READABLE:
                s = table.slot(k, host)
                out[k] = (s, self._observe(s, k))
        return out
