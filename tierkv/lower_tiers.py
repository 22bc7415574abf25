"""The host and cold tiers: compression of idle or displaced host pages, and decoding back.

Host pages that no live sequence needs soon (idle for ``compress_after`` steps, or displaced when
the host tier fills) are encoded by the store's codec into the cold pool's smaller slots; a load
decodes them straight into a device slot. Encoding and decoding are jobs of the transfer engine
(``submit_call``: a host function on the stream of its two arenas), so its priorities, bounds,
cancellation rules and statistics cover them like every other copy.

Each cold slot keeps the CRC-32C of the encoded payload written there (in the page table's
:class:`~tierkv.page_sums.PageSums`), checked before the payload is decoded: a lossy codec's
output is not the page's raw bytes, so the raw checksum cannot vouch for it; the payload's can,
for the bytes between encode and decode. A payload that fails its check is never decoded: the
load fails with :class:`~tierkv.errors.CorruptPageError`, the copy is counted (``corrupt``,
``cold``) and dropped once no owner pins it.

The codec's moves are handlers of the core's `Moves` registry (:meth:`ColdStorage.register_moves`:
host -> cold, cold -> device, cold -> host), looked up by media like every other move. Pages
leaving the host tier are announced (:class:`~tierkv.departures.Departures`: a page server's
listeners) and offered, exact bytes, to the remote tier and the lower chain first. A
collaborator of the tier core (:class:`tierkv.tiers.TierSet`), built from its
:class:`~tierkv.core_context.CoreContext`: it changes page state only through the page table,
and tells the core of every change by ``progress``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import cast

import torch

from tierkv import page_sums
from tierkv.codecs import Codec
from tierkv.core_context import CoreContext
from tierkv.errors import CorruptPageError, TierFullError
from tierkv.jobs import job_done, when_done
from tierkv.keys import PageKey
from tierkv.page_sums import NO_SUM, row_sums
from tierkv.runtime import Arena, Priority, TransferEngine, TransferHandle
from tierkv.tier import Batch, Moves, Target
from tierkv.tier_names import COLD, DEVICE

__all__ = ["ColdStorage"]


class ColdStorage:
    """The host and cold tiers of one tier core."""

    def __init__(self, ctx: CoreContext, codec: Codec | None) -> None:
        self._ctx = ctx
        self._table = ctx.table
        self._arenas = ctx.arenas
        self._engine = ctx.engine
        self.codec = codec
        self.register_moves(ctx.moves)
        # cold pages that failed their checksum while an owner pinned them: dropped by
        # `drop_bad` once unowned (until then every load of them fails, typed)
        self.bad: set[PageKey] = set()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one cold slot (an encoded page's room); 0 without a cold tier."""
        arena = self._arenas.get(COLD)
        return 0 if arena is None else arena.slot_bytes

    def forget_in(self, tier: str, keys: Sequence[PageKey]) -> None:
        """Remove readable, unpinned pages from one tier."""
        table = self._table
        here = cast(list[PageKey], table.idle(keys, tier))
        if here:
            table.remove(here, tier)
            if tier == self._ctx.top:
                self._ctx.departures.left(here)

    def register_moves(self, moves: Moves) -> None:
        """Register the codec's moves: host -> cold (encode; from the leased tier of a store
        without a host tier) and cold -> device / host (decode). Nothing without a codec (no
        cold tier)."""
        if self.codec is not None:
            ctx = self._ctx
            moves.register(ctx.medium(ctx.top), COLD, self._encode_move)
            for medium in dict.fromkeys(ctx.medium(t) for t in ctx.arenas if t != COLD):
                moves.register(COLD, medium, self._decode_move)

    def _decode_move(self, engine: TransferEngine, target: Target, batch: Batch) -> TransferHandle:
        """Decode cold pages (the batch: keys, the cold arena, its slots) into the target's
        slots (device or host): a job of the transfer engine (queued now). Each payload is
        checked against its checksum first: the job fails with CorruptPageError (nothing
        decoded) when one differs."""
        stats = self._ctx.stats
        dst, dst_slots = target.arena, list(target.slots)
        cold, keys, src_slots = batch.arena, batch.keys, list(batch.slots)

        def work() -> None:
            t0 = time.perf_counter()
            out = self._checked_decode(keys, cold, src_slots)
            tensor = dst.tensor
            idx = _index(dst_slots).to(tensor.device)
            tensor.index_copy_(0, idx, out.to(tensor.device))
            stats.decode_s += time.perf_counter() - t0

        return engine.submit_call(
            cold, src_slots, dst, dst_slots, work, priority=target.priority, after=target.after
        )

    def _checked_decode(
        self, keys: Sequence[bytes], cold: Arena, slots: Sequence[int]
    ) -> torch.Tensor:
        """The cold ``slots`` (pages ``keys``) decoded in host memory, ``[N, page_bytes]``
        uint8, each payload checked against its checksum first: CorruptPageError (nothing
        decoded) when one differs."""
        codec, spec = self.codec, self._ctx.spec
        assert codec is not None
        if page_sums.enabled():
            want = self._table.sums.copies(COLD, slots)
            got = row_sums(cold.array, slots)
            bad = [i for i, (w, g) in enumerate(zip(want, got)) if w != NO_SUM and w != g]
            if bad:
                raise CorruptPageError(
                    f"{len(bad)} of {len(slots)} cold pages failed their checksum",
                    tier=COLD,
                    pages=len(bad),
                    keys=[keys[i] for i in bad if i < len(keys)],
                )
        data = cold.tensor.index_select(0, _index(slots))
        out = torch.empty((len(slots), spec.page_bytes), dtype=torch.uint8)
        codec.decode(data, spec, out=out)
        return out

    def decode_on_host(self, keys: Sequence[PageKey]) -> torch.Tensor:
        """Cold pages decoded in host memory for attention there, ``[N, page_bytes]`` uint8:
        pinned in the cold tier meanwhile (none evicted or overwritten), each payload checked
        against its checksum and decoded by the codec on the host (int8: the native one-pass
        decode). No device slot, no transfer job, no page state changes but the pin's.

        Raises UnknownPageError / PageStateError (nothing pinned) when one is not readable in
        the cold tier, CorruptPageError when a payload fails its checksum (counted; the page
        dropped once nothing pins it, as for a load)."""
        spec = self._ctx.spec
        if self.codec is None or not keys:
            return torch.empty((0, spec.page_bytes), dtype=torch.uint8)
        table = self._table
        try:
            slots = table.prepare_load(keys, COLD)
            try:
                t0 = time.perf_counter()
                out = self._checked_decode(keys, self._arenas[COLD], slots)
                self._ctx.stats.decode_s += time.perf_counter() - t0
            finally:
                table.complete_load(keys, COLD)
                self._ctx.progress()
        except CorruptPageError as exc:
            self.corrupt(exc)  # (after the unpin: the bad pages can go now)
            raise
        return out

    def _encode_move(self, engine: TransferEngine, target: Target, batch: Batch) -> TransferHandle:
        """Encode host pages (the batch) into the target's cold slots, their payloads'
        checksums recorded: a job of the transfer engine whose result is the seconds the encode
        took."""
        codec, spec, table = self.codec, self._ctx.spec, self._table
        assert codec is not None
        cold, dst = target.arena, list(target.slots)
        keys, host, src = batch.keys, batch.arena, list(batch.slots)
        # (head-sparse needs each page's layer: the page key's last 2 bytes)
        layers = [int.from_bytes(k[-2:], "little") for k in keys] if codec.needs_layers else None

        def work() -> float:
            t0 = time.perf_counter()
            pages = host.tensor.index_select(0, _index(src))
            enc = (
                codec.encode(pages, spec)
                if layers is None
                else codec.encode(pages, spec, layers=layers)
            )
            cold.tensor.index_copy_(0, _index(dst), enc)
            if page_sums.enabled():  # the slots are this job's until it ends: no race
                table.sums.set_copies(COLD, dst, row_sums(cold.array, dst))
            return time.perf_counter() - t0

        return engine.submit_call(
            host, src, cold, dst, work, priority=target.priority, after=target.after
        )

    def corrupt(self, error: BaseException | None) -> BaseException | None:
        """Of a failed load's error: when a cold payload failed its checksum, count it, drop
        the pages that no owner pins and return the CorruptPageError itself (typed for the
        caller); any other error as it is."""
        cause = error if isinstance(error, CorruptPageError) else getattr(error, "__cause__", None)
        if not isinstance(cause, CorruptPageError):
            return error
        self._ctx.stats.corrupt[COLD] = self._ctx.stats.corrupt.get(COLD, 0) + cause.pages
        self.bad.update(cause.keys)
        self.drop_bad()
        return cause

    def drop_bad(self) -> None:
        """Drop the corrupt cold pages that nothing pins any more."""
        self.forget_in(COLD, list(self.bad))
        self.bad.intersection_update(self._table.present(self.bad, COLD))

    async def make_room(
        self,
        n: int,
        keep: Collection[PageKey] | None = None,
        keep_order: Sequence[PageKey] | None = None,
        for_keys: Sequence[PageKey] = (),
    ) -> None:
        """Free ``n`` host slots (the leased tier's in a store without a host tier): unowned
        victims are offered to the remote tier, then compressed into cold, or dropped. Fewer
        when too few are evictable (the reservation that follows reports the tier as full).
        ``keep`` / ``keep_order``: pages taken last; ``for_keys``: the pages the room is for
        (``PageTable.prepare_evict``)."""
        table, top = self._table, self._ctx.top
        free = table.capacity(top) - table.used(top)
        if free >= n:
            return
        victims = cast(
            list[tuple[PageKey, int]],
            table.prepare_evict(top, n - free, keep=keep, keep_order=keep_order, for_keys=for_keys),
        )
        if not victims:
            return
        keys = [k for k, _ in victims]
        ok = True
        try:
            await self._ctx.departures.offer_remote(victims)  # exact bytes, before they change
            await self._ctx.departures.spill_below(victims)
            if self.codec is not None:
                await self._compress(victims)
            else:
                self._ctx.stats.pages_dropped += len(keys)
        except TierFullError:
            self._ctx.stats.pages_dropped += len(keys)  # cold is full of owned pages: drop them
        except BaseException:
            ok = False
            raise
        finally:
            table.complete_evict(keys, top, ok=ok)
            if ok:
                self._ctx.departures.left(keys)
            else:  # back: pages owned while they were leaving get their owners' pin now
                self._ctx.owners.pin_owned(cast(list[PageKey], table.readable(keys, top)), top)
            self._ctx.progress()  # a lower copy in flight landed (or left)

    async def _compress(self, victims: list[tuple[PageKey, int]]) -> None:
        """Encode host pages into cold slots (unowned cold pages are dropped for room)."""
        table = self._table
        keys = [k for k, _ in victims]
        alloc = table.prepare_store(keys, COLD)
        if alloc is None:
            raise TierFullError("cold tier full of owned pages")
        self._ctx.stats.pages_dropped += len(alloc.evicted)
        new = set(alloc.keys)
        todo = [(k, s) for k, s in victims if k in new]
        cold_of = dict(zip(alloc.keys, alloc.slots))
        if not todo:  # every page is in cold already (or was not admitted): nothing to encode
            table.complete_store(alloc.keys, COLD)
            return
        target = Target(self._arenas[COLD], [cold_of[k] for k, _ in todo], Priority.WRITEBACK)
        try:
            top = self._ctx.top
            batch = Batch([k for k, _ in todo], self._arenas[top], [s for _, s in todo])
            handle = self._ctx.moves.get(self._ctx.medium(top), COLD)(self._engine, target, batch)
        except BaseException:  # nothing queued (the engine closed): the cold slots go back
            table.complete_store(alloc.keys, COLD, ok=False)
            raise
        try:
            await job_done(handle)
        except BaseException:
            handle.cancel()  # dropped if still pending; else its slots are freed once it ends

            def undo() -> None:
                table.complete_store(alloc.keys, COLD, ok=False)
                self._ctx.progress()

            when_done(handle, undo)
            raise
        self._ctx.stats.encode_s += cast(float, handle.result())
        table.complete_store(alloc.keys, COLD)
        self._ctx.owners.pin_owned(cast(list[PageKey], alloc.keys), COLD)
        self._ctx.stats.pages_compressed += len(alloc.keys)

    async def compress_idle(self, keys: Sequence[PageKey]) -> int:
        """Compress these host pages (idle ones, chosen by the caller) into cold; returns count.

        Pages on the device, in flight, or pinned by anything but their owner are skipped.
        """
        if self.codec is None:
            return 0
        table, owners, top = self._table, self._ctx.owners, self._ctx.top
        pick: list[tuple[PageKey, int]] = []
        for k in keys:
            if (top != DEVICE and table.present([k], DEVICE)) or not table.lookup([k], top):
                continue
            if table.pins(k, top) != (1 if owners.holds_pin(k, top) else 0):
                continue
            if table.present([k], COLD):
                continue
            pick.append((k, table.slot(k, top)))
        room = table.capacity(COLD) - table.used(COLD) + table.evictable(COLD)
        pick = pick[:room]
        if not pick:
            return 0
        pk = [k for k, _ in pick]
        table.prepare_load(pk, top)  # hold the sources while encoding
        try:
            await self._ctx.departures.offer_remote(pick)
            await self._ctx.departures.spill_below(pick)  # exact bytes: cold is lossy
            await self._compress(pick)
        except TierFullError:
            return 0
        finally:
            table.complete_load(pk, top)
            self._ctx.progress()
        moved = cast(list[PageKey], table.present(pk, COLD))
        for k in moved:
            owners.unpin(k, top)  # the owner's pin moved to the cold copy
        self.forget_in(top, moved)
        return len(moved)


def _index(slots: Sequence[int]) -> torch.Tensor:
    """Slots as an int64 index tensor (``torch.tensor([])`` is a float tensor, which
    ``index_select`` refuses: an empty batch must still index)."""
    return torch.tensor(slots, dtype=torch.int64)
