"""Disk I/O as TransferEngine jobs: how the tier core moves pages between a host arena and disk.

Both directions run in the engine's async lane (``submit_async``: bounded by ``max_external``,
so disk I/O never holds the copy streams) with the host slots pinned until the job ends::

    handle = submit_load(engine, disk, keys, host, slots)     # disk -> host
    hits = await handle                                        # handle.result(): list[bool]
    handle = submit_save(engine, disk, keys, host, slots)     # host -> disk
    statuses = (await handle, handle.result())[1]             # list[StoreStatus]

A job cancelled while it runs (``aclose(cancel_pending=True)``) still ends its I/O before the
slots are unpinned (see `DiskPages.read`): no slot is handed out while a thread writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import InvalidInputError
from tierkv.runtime import Arena, Priority, TransferEngine, TransferHandle

from .pages import DiskPages
from .status import StoreStatus


def _check(disk: DiskPages, keys: Sequence[bytes], arena: Arena, slots: Sequence[int]) -> None:
    if arena.slot_bytes != disk.page_bytes:
        raise InvalidInputError(
            f"arena {arena.name!r} has {arena.slot_bytes}-byte slots, the disk "
            f"{disk.page_bytes}-byte pages"
        )
    if len(keys) != len(slots):
        raise InvalidInputError(f"{len(keys)} keys for {len(slots)} slots")


def submit_load(
    engine: TransferEngine,
    disk: DiskPages,
    keys: Sequence[bytes],
    arena: Arena,
    slots: Sequence[int],
    *,
    priority: Priority = Priority.PREFETCH,
) -> TransferHandle:
    """Queue a read of `keys` from `disk` into host `slots` of `arena`; the handle's result is
    a list of verified hits (a miss leaves its slot's bytes unspecified). Raises
    InvalidInputError (sizes), or as ``TransferEngine.submit_async``; nothing is queued then.
    Must be called on the engine's event loop."""
    _check(disk, keys, arena, slots)
    ids, ks = [int(s) for s in slots], list(keys)

    async def start() -> list[bool]:
        return await disk.read(ks, [arena.slot_view(i) for i in ids])

    return engine.submit_async(arena, [], arena, ids, start, priority=priority)


def submit_save(
    engine: TransferEngine,
    disk: DiskPages,
    keys: Sequence[bytes],
    arena: Arena,
    slots: Sequence[int],
    *,
    persistent: Sequence[bool] | None = None,
    priority: Priority = Priority.WRITEBACK,
) -> TransferHandle:
    """Queue a write of host `slots` of `arena` to `disk` under `keys`; the handle's result is
    a StoreStatus per key (only STORED and PRESENT are on disk). Raises like `submit_load`."""
    _check(disk, keys, arena, slots)
    ids, ks = [int(s) for s in slots], list(keys)

    async def start() -> list[StoreStatus]:
        return await disk.write(ks, [arena.slot_view(i) for i in ids], persistent)

    return engine.submit_async(arena, ids, arena, [], start, priority=priority)
