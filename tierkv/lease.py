"""A lease: sequences' pages pinned on the device while compute reads and appends KV.

A lease depends on its store only through :class:`~tierkv.lease_host.LeaseHost`, the small
public surface the store implements (this module never imports the store)::

    store.lease(ids) --> Lease(store) --enter--> admission, tiers.acquire_device, lease_began
                                      --exit---> tiers.unpin_device, lease_ended, lease_wrote

This file stays whole (over 400 lines): it is the one class that reads and writes leased pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch

from tierkv import validate
from tierkv.boundary import async_boundary, boundary
from tierkv.errors import PageStateError, SequenceError, SpecError, UnknownPageError
from tierkv.lease_host import LeaseHost
from tierkv.runtime import Priority
from tierkv.sequence import SequenceState, page_key
from tierkv.tiers import DEVICE, TierSet

__all__ = ["Lease", "LeaseHost", "acquire_current"]


async def acquire_current(
    tiers: TierSet,
    keys: list[bytes],
    name: Callable[[], list[bytes]],
    check: Callable[[], None],
    deadline: float,
) -> tuple[list[bytes], int]:
    """Pin ``keys`` on the device (:meth:`TierSet.acquire_device`, by ``deadline``, loop
    time); returns the keys pinned and the pages waited for. ``name()`` names the pages again
    (by their current keys) and ``check()`` raises SequenceError when a sequence was released.

    A wait for room or for copies pins nothing of a block yet to come, so another lease's end
    may publish it meanwhile (its pages renamed to content keys): then the pages are named
    again and pinned under their new names; only a page in no tier under its current name is
    an UnknownPageError, and a sequence released meanwhile (before or during the wait) is a
    SequenceError with nothing left pinned.
    """
    while True:
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            waited = await tiers.acquire_device(keys, Priority.DEMAND, timeout=left)
        except UnknownPageError:
            check()
            now = name()
            if now == keys:
                raise
            keys = now
            continue
        try:
            check()
        except BaseException:
            tiers.unpin_device(keys)
            raise
        return keys, waited


class Lease:
    """Device-resident views of some sequences' pages (some layers), pinned until exit.

    Created by :meth:`tierkv.store.KVStore.lease`; use as an async context manager.
    """

    def __init__(
        self,
        store: LeaseHost,
        seqs: list[SequenceState],
        layers: list[int],
        blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        # Few tracked objects per lease, and none per page or per append: a lease outlives
        # young collector passes while a thousand sequences take turns, and whatever it holds
        # then is promoted towards the next full pass (see docs/store.md, the loop at scale).
        self._store = store
        self._seqs = tuple(seqs)  # let go at exit: a finished lease a caller keeps holds none
        self._order = {s.seq_id: i for i, s in enumerate(seqs)}  # str -> int: untracked
        self.layers: Sequence[int] = tuple(layers)  # of ints: untracked after a young pass
        self._layer_bits = sum(1 << layer for layer in set(layers))
        # the device pages this lease pins (bytes -> None: a dict the collector does not track),
        # the one record of what it may read and write: pages another lease of the same
        # sequence added are pinned here before they are read or written
        self._pins: dict[bytes, None] = {}
        # written (sequence, layer, block) as one int each (see _written_key): untracked
        self._written: dict[int, None] = {}
        # (sequence, layer) as one int each that this lease took as their writer (see
        # tierkv.step_claims): the store is asked once per layer, not at every append
        self._writer_of: dict[int, None] = {}
        self._active = False
        self._entering = False  # (between __aenter__'s start and its end)
        self._spent = False  # entered and left: it holds no sequence any more
        self._held: int | None = None  # device footprint admitted for this lease
        self.waited_pages = 0
        # only these blocks of each sequence (in every leased layer) are pinned at entry; None:
        # all (sparse attention leases the pages it attends, see tierkv.attention)
        self._blocks = None if blocks is None else {s: tuple(b) for s, b in blocks.items()}

    @async_boundary
    async def __aenter__(self) -> Lease:
        """Pin the pages on the device, loading what is not resident.

        When other leases' pins leave no room, waits (first come, first served; see
        :mod:`tierkv.admission`) at most the store's timeout.

        Raises:
            TierFullError: the pages can never be resident at once (at once), or no room came
                before the timeout.
            UnknownPageError: a page is in no tier.
            SequenceError: a sequence was released while the lease waited, or the lease is
                entered already (a second entry pinned every page twice, and its exit
                left one set pinned for good) or ran already (an entry pinned nothing), or
                a sequence is in an entered step plan over one of the leased layers (one
                writer at a time: :mod:`tierkv.step_claims`).
        On error or cancellation nothing stays pinned or admitted.
        """
        if self._active or self._entering:
            raise SequenceError("this lease is entered already (enter it once at a time)")
        if self._spent:  # (it let go of its sequences: an entry would pin nothing)
            raise SequenceError("this lease ran already: take a new one (store.lease)")
        steps = self._store.steps
        steps.enter_lease(self._seqs, self._layer_bits)  # (a sequence in a step plan: raises)
        self._entering = True
        try:
            return await self._enter()
        except BaseException:
            steps.leave_lease(id(self), self._seqs, self._layer_bits)
            raise
        finally:
            self._entering = False

    async def _enter(self) -> Lease:
        store = self._store
        tiers = store.tiers
        keys = self._keys()
        tiers.room.ensure_fits(len(keys))
        # Yield once: compute between leases rarely suspends, and background prefetches and
        # write-backs only advance when the loop runs. (When this loop turn's store work is
        # spent, wait for a later turn in the store's queue: see tierkv.turns.)
        await store.turns.pause(always=True)
        t0 = time.perf_counter()  # (charged to the turn budget at the end: see below)
        deadline = tiers.changes.deadline(store.timeout)
        footprint = len(keys) + self._reserve()
        # a partial, not a lambda: a closure would make its variables cells (tracked objects)
        # for the whole of this coroutine, which may wait across young collector passes
        self._held = await store.admission.enter(
            footprint, deadline, partial(tiers.room.full_error, footprint, store.timeout)
        )
        try:
            keys, waited = await self._acquire(keys, deadline)
        except BaseException:
            self._leave()
            raise
        t1 = time.perf_counter()
        # the store work of this entry: all of it when nothing was loaded (no suspension);
        # when pages were loaded the task slept meanwhile, and only what follows is counted
        store.turns.charge((t1 - t0) if not waited else 0.0)
        self._pins = dict.fromkeys(keys)
        self._active = True
        self.waited_pages = waited
        c = store.counters
        c.pages_leased += len(keys)
        c.device_hits += len(keys) - waited
        c.late_fetches += waited
        store.lease_began(keys)  # (the idle clock is touched once, when the lease ends)
        if waited:
            store.timeline.span("wait for pages", "compute", t0, t1, pages=waited)
        return self

    async def _acquire(self, keys: list[bytes], deadline: float) -> tuple[list[bytes], int]:
        """Pin ``keys`` on the device (see :meth:`TierSet.acquire_device`); returns the keys
        pinned and the pages waited for. The sequences' pages are named again when a page was
        renamed meanwhile (another lease's end published a full block under its content key):
        only a page that is in no tier under its current name is an error, and a sequence
        released meanwhile is a SequenceError, not a missing page."""
        return await acquire_current(self._store.tiers, keys, self._keys, self._check, deadline)

    def _check(self) -> None:
        for seq in self._seqs:
            self._check_live(seq)

    def _keys(self) -> list[bytes]:
        """The leased pages by their current names."""
        if self._blocks is None:
            return list(dict.fromkeys(k for s in self._seqs for k in s.all_pages(self.layers)))
        keys: dict[bytes, None] = {}
        for s in self._seqs:
            chosen = self._blocks.get(s.seq_id, ())
            for layer in self.layers:
                pages = s.pages(layer)
                keys.update(dict.fromkeys(pages[b] for b in chosen if 0 <= b < len(pages)))
        return list(keys)

    def _reserve(self) -> int:
        """Pages this lease's appends may open: enough for every declared token's KV (at least
        one more token) of each sequence in each leased layer."""
        n = 0
        for seq in self._seqs:
            t = seq.page_tokens
            for layer in self.layers:
                have = seq.kv_len_of(layer)
                n += max(0, -(-max(seq.num_tokens, have + 1) // t) - -(-have // t))
        return n

    def _leave(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._store.closed:
                self._store.admission.leave(held)

    @async_boundary
    async def __aexit__(self, *exc: object) -> None:
        t0 = time.perf_counter()
        try:
            store = self._store
            if self._active:  # (its writer's entries: tierkv.step_claims)
                store.steps.leave_lease(id(self), self._seqs, self._layer_bits)
                self._writer_of = {}
            self._spent |= self._active
            self._active = False
            if store.closed:
                self._seqs = ()
                return  # close() already let go of every page
            pinned: tuple[bytes, ...] = ()
            try:
                if self._pins:
                    pinned, self._pins = tuple(self._pins), {}
                    store.tiers.unpin_device(pinned)
            finally:
                self._leave()
            store.lease_ended(self._seqs, pinned)
            # written pages by their current keys: lease_ended may have renamed full blocks
            seqs, self._seqs = self._seqs, ()
            live = [store.is_live(s) for s in seqs]
            written = []
            for key in self._written:
                i, layer, b = self._unpack(key)
                if live[i]:
                    written.append(page_key(seqs[i].block(b), layer))
            self._written = {}
            store.lease_wrote(written)
        finally:
            self._store.turns.charge(time.perf_counter() - t0)

    def _written_key(self, seq_id: str, layer: int, block: int) -> int:
        """(sequence, layer, block) as one int: ``(block * L + layer) * S + i``."""
        return (block * self._store.spec.num_layers + layer) * len(self._order) + self._order[
            seq_id
        ]

    def _unpack(self, key: int) -> tuple[int, int, int]:
        rest, i = divmod(key, len(self._order))
        block, layer = divmod(rest, self._store.spec.num_layers)
        return i, layer, block

    def _seq(self, seq_id: str, layer: int) -> SequenceState:
        if not self._active:
            raise SequenceError("the lease is not active (use it inside `async with`)")
        i = self._order.get(seq_id)
        if i is None:
            raise SequenceError(f"sequence {seq_id!r} is not in this lease")
        seq = self._seqs[i]
        if not self._layer_bits >> layer & 1:
            raise SpecError(f"layer {layer} is not in this lease (leased: {self.layers})")
        return seq

    def _hold(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin for this lease the pages of ``keys`` it does not pin yet (pages another lease of
        the same sequence added after this one began) that are readable on the device now;
        returns the rest (not on the device, or in flight), which this lease must not touch."""
        pins = self._pins
        missing = [k for k in keys if k not in pins]
        if not missing:
            return []
        tiers = self._store.tiers
        ready = tiers.table.readable(missing, DEVICE)
        if ready:
            tiers.pin_device(ready)
            pins.update(dict.fromkeys(ready))
        return [k for k in missing if k not in pins]

    @boundary
    def kv(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of a sequence in one layer: two ``[H, S, D]`` tensors.

        Raises SequenceError (a sequence not in this lease, or the lease is not active, or KV
        that another lease of the sequence appended after this one began has left the device
        since: lease it again), SpecError (a layer not in it), InvalidTypeError (an id or layer
        of the wrong type).
        """
        t0 = time.perf_counter()
        try:
            seq_id, layer = (
                validate.seq_id(seq_id),
                validate.layer(layer, self._store.spec.num_layers),
            )
            seq = self._seq(seq_id, layer)
            spec = self._store.spec
            pages = seq.pages(layer)
            n, s = len(pages), seq.kv_len_of(layer)
            if not n:
                device = self._store.tiers.pages.device
                empty = torch.empty(
                    (spec.num_kv_heads, 0, spec.head_dim), dtype=spec.dtype, device=device
                )
                return empty, empty.clone()
            if self._hold(pages):  # never read a slot this lease does not pin
                raise SequenceError(
                    f"sequence {seq_id!r} layer {layer}: KV another lease appended after this "
                    "one began is no longer on the device; lease the sequence again"
                )
            tiers = self._store.tiers
            kv = tiers.pages.gather_tokens(tiers.pages.device_slots(pages))[
                :, :, :s
            ]  # [2, H, S, D]
            return kv[0], kv[1]
        finally:
            self._store.turns.charge(time.perf_counter() - t0)

    @boundary
    def kv_blocks(
        self, seq_id: str, layer: int, blocks: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of some blocks (ascending page indices) of a sequence in one layer: two
        ``[H, n, D]`` tensors of those pages' tokens in order (the last page of the layer only
        up to its length). The pages must be pinned by this lease (``store.lease(..., blocks=)``
        or appended in it).

        Raises SequenceError as :meth:`kv` and for a block that is not pinned here, SpecError
        for a block out of range or out of order.
        """
        seq_id, layer = validate.seq_id(seq_id), validate.layer(layer, self._store.spec.num_layers)
        seq = self._seq(seq_id, layer)
        pages = seq.pages(layer)
        chosen = list(blocks)
        if any(b < 0 or b >= len(pages) for b in chosen) or chosen != sorted(set(chosen)):
            raise SpecError(f"blocks must be ascending pages of the {len(pages)}, got {chosen}")
        keys = [pages[b] for b in chosen]
        if self._hold(keys):
            raise SequenceError(f"sequence {seq_id!r} layer {layer}: a block is not pinned here")
        tiers = self._store.tiers
        kv = tiers.pages.gather_tokens(tiers.pages.device_slots(keys))
        if chosen and chosen[-1] == len(pages) - 1:  # the layer's last page: only its tokens
            kv = kv[:, :, : kv.shape[2] - (len(pages) * seq.page_tokens - seq.kv_len_of(layer))]
        return kv[0], kv[1]

    @async_boundary
    async def append(self, seq_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append KV of ``n`` new tokens (``k``, ``v``: ``[H, n, D]`` in the spec's dtype).

        The bytes and the sequence's KV length change together or not at all, whatever is
        cancelled when: an append that fails (or is cancelled) leaves no page, pin or owner
        behind and the length as it was.

        Raises SpecError for a wrong shape, dtype or device (k and v must be on the device
        tier's device or the cpu), InvalidTypeError for a k or v that is not a tensor (or an id
        or layer of the wrong type), SequenceError for a sequence or layer not in this lease,
        a sequence released meanwhile, or one that another lease appended to (the same layer)
        while this append waited, or that another entered lease appends to (the same layer:
        one writer at a time, :mod:`tierkv.step_claims`), TierFullError when the device has
        no room for a new page.
        Checked before anything is allocated.
        """
        seq_id, layer = validate.seq_id(seq_id), validate.layer(layer, self._store.spec.num_layers)
        seq = self._seq(seq_id, layer)
        store = self._store
        spec = store.spec
        k, v = validate.kv_tensors(spec, k, v, store.tiers.pages.device)
        n = k.shape[1]
        if n == 0:
            return
        mine = self._order[seq_id] * spec.num_layers + layer
        if mine not in self._writer_of:  # one writer of a layer at a time: else raises
            store.steps.write(id(self), seq, layer)
            self._writer_of[mine] = None
        await store.turns.pause()
        t0 = time.perf_counter()
        try:
            seq = self._seq(seq_id, layer)  # (the lease may have ended meanwhile)
            self._check_live(seq)
            tiers = store.tiers
            device = tiers.pages.device
            if k.device != device or v.device != device:
                try:  # on the device first: a tensor that cannot be copied fails before allocating
                    k, v = k.to(device), v.to(device)
                except (RuntimeError, NotImplementedError) as exc:
                    raise SpecError(f"k, v: cannot be copied to {device}: {exc}") from exc
            t = spec.page_tokens
            start = seq.kv_len_of(layer)
            end = start + n
            have = -(-start // t)  # pages this layer already has
            need = -(-end // t)
            first = start // t
            # the partly filled last page, pinned by this lease before it is written (another
            # lease of the sequence may have added it: its pin is not this lease's)
            rest = self._hold([page_key(seq.block(b), layer) for b in range(first, have)])
            if rest:
                try:
                    await tiers.acquire_device(rest, Priority.DEMAND, timeout=store.timeout)
                except UnknownPageError:  # released meanwhile: its private pages went
                    self._check_unchanged(seq, layer, start)
                    raise
                self._pins.update(dict.fromkeys(rest))
                self._check_unchanged(seq, layer, start)
            while seq.num_blocks < need:  # (extra private blocks left by a failure are harmless)
                seq.append_block(seq.private_block(seq.num_blocks), shared=False)
            new = [page_key(seq.block(b), layer) for b in range(have, need)]
            if new and store.tenants is not None:  # its tenant pays for the pages it makes
                store.tenants.charge(new, seq.tenant, new=True)  # (its private pages)
            if new:
                mine = len(self._pins)  # distinct: acquired once each, new pages are new
                try:
                    slots = await tiers.reserve_device(new, mine=mine, timeout=store.timeout)
                except PageStateError:  # another append made them while this one waited
                    self._check_unchanged(seq, layer, start)
                    raise
            pinned = owned = False
            try:
                if new:  # the wait may have changed the sequence: recheck, then no await
                    self._check_unchanged(seq, layer, start)
                    tiers.pages.zero_device(
                        slots
                    )  # a reused slot holds another page's bytes: never leak
                    tiers.commit_device(new)
                    tiers.pin_device(new)  # pinned for the rest of the lease
                    pinned = True
                    tiers.ownership.own(new)
                    owned = True
                written = [page_key(seq.block(b), layer) for b in range(first, need)]
                pos = start
                for b, slot in enumerate(tiers.pages.device_slots(written), first):
                    off = pos - b * t
                    m = min(t - off, end - pos)
                    page = tiers.pages.page(slot)
                    if m == n:  # the whole append in one page (a decode step): no slicing
                        page[0, :, off : off + m] = k
                        page[1, :, off : off + m] = v
                    else:
                        page[0, :, off : off + m] = k[:, pos - start : pos - start + m]
                        page[1, :, off : off + m] = v[:, pos - start : pos - start + m]
                    pos += m
                tiers.pages.mark_dirty(written)
                tiers.pages.seal(written[: end // t - first])  # the pages this append filled
            except BaseException:  # undo every step: no page, pin or owner is left behind
                tiers.abort_device(new, pinned=pinned, owned=owned)
                raise
            self._pins.update(dict.fromkeys(new))
            for pos in range(start - start % t, end, t):
                self._written[self._written_key(seq_id, layer, pos // t)] = None
            seq.set_kv_len(layer, end)
        finally:
            store.turns.charge(time.perf_counter() - t0)

    def _check_live(self, seq: SequenceState) -> None:
        if not self._store.is_live(seq):  # released (or its id reused) inside the lease
            raise SequenceError(f"sequence {seq.seq_id!r} was released: nothing can be appended")

    def _check_unchanged(self, seq: SequenceState, layer: int, start: int) -> None:
        """After an append's wait: the lease still active, the sequence live, and no other
        append to this layer in between (the positions this one writes are still its end)."""
        self._seq(seq.seq_id, layer)
        self._check_live(seq)
        if seq.kv_len_of(layer) != start:
            raise SequenceError(
                f"sequence {seq.seq_id!r} layer {layer}: another lease appended to it while "
                "this append waited (nothing was appended)"
            )

    def sequences(self) -> Sequence[str]:
        """Ids of the leased sequences."""
        return list(self._order)
