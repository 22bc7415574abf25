"""Put a store's host tier where a transport can serve it.

A peer can only target memory its transport shares: any registered buffer for tcp (a server
on this side reads it), but only a shared-memory segment for shm (the peer maps it). So the
first transport *rebinds* the store's host arena onto memory it can share (for shm a segment
this module creates, else the transport's ``allocate()``); the others register that memory::

    store.tiers.glue.host_arena     [ slot 0 | slot 1 | ... | slot n-1 ]  <- one buffer
                                  ^ shm segment /dev/shm/tkv-host-<pid>-<start>-... (rebound,
                                    shm first; `tierkv serve` removes those of dead owners)
                                  ^ also registered with tcp (its server reads it)

Rebinding swaps the arena object, so it must happen before the store holds any host page.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import numpy.typing as npt

import tierkv.transports as transports
from tierkv.remote.errors import RemoteError, map_transport_error
from tierkv.runtime import Arena
from tierkv.store import KVStore
from tierkv.tiers import HOST
from tierkv.transports.shm import segment_name

__all__ = ["SharedArena", "register_host_arena", "share_host_arena"]


class SharedArena:
    """The host arena's memory as registered with one transport; `close` after the transport
    has closed (unlinks a segment this module created)."""

    def __init__(self, region: transports.Region, segment: SharedMemory | None = None) -> None:
        self.region = region
        self._segment = segment

    @property
    def segment(self) -> SharedMemory | None:
        """The shared-memory segment this module created for it (None: none, or closed)."""
        return self._segment

    def close(self) -> None:
        """Release the segment we created, if any. Idempotent."""
        seg, self._segment = self._segment, None
        if seg is not None:
            with contextlib.suppress(BufferError):
                seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()


def _segment_memory(transport: transports.Transport, nbytes: int) -> tuple[Any, SharedArena]:
    """A shared-memory segment registered with shm, and a mapping of our own for the arena
    (so that the segment object itself carries no exported buffer when it is closed)."""
    seg = SharedMemory(name=segment_name("tkv-host"), create=True, size=nbytes)
    shared = SharedArena(transport.register_memory(seg), seg)
    fd = os.open(f"/dev/shm/{seg.name}", os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return mm, shared


def share_host_arena(store: KVStore, transport: transports.Transport) -> SharedArena:
    """Rebind ``store``'s host arena onto memory that ``transport`` can share.

    shm: a shared-memory segment peers map; other transports: their ``allocate()``. Raises
    RemoteError when the host tier already holds pages (or the memory cannot be had), or the
    store has no host tier (host-first).
    """
    tiers = store.tiers
    if tiers.top != HOST:
        raise RemoteError(
            "a store without a host tier (host-first: its leased pages are views of their "
            "arena) cannot share it; serve a store whose chain has a device and a host tier"
        )
    old = tiers.glue.host_arena
    if tiers.table.used(HOST):
        raise RemoteError("share the host arena before the store holds host pages")
    try:
        if transport.kind == "shm":
            mem, shared = _segment_memory(transport, old.nbytes)
        else:
            shared = SharedArena(transport.allocate(old.nbytes))
            mem = shared.region.view
    except transports.TransportError as exc:
        raise map_transport_error(exc, "sharing the host arena") from exc
    except OSError as exc:
        raise RemoteError(f"cannot make a shared host arena of {old.nbytes} bytes: {exc}") from exc
    buf: npt.NDArray[np.uint8] = np.frombuffer(mem, dtype=np.uint8, count=old.nbytes)
    backend: Any = tiers.engine.backend
    if hasattr(backend, "register_host_arena"):  # cuda: pins the new memory chunk by chunk
        new = backend.register_host_arena(old.name, buf, old.slot_bytes)
    else:
        new = Arena(old.name, old.slot_bytes, old.num_slots, backend=old.backend, buffer=buf)
    tiers.glue.replace_host_arena(new)  # its slots are handed over to the tier core
    return shared


def register_host_arena(
    store: KVStore, transport: transports.Transport, like: SharedArena | None = None
) -> SharedArena:
    """Register the store's host arena, as it is, with ``transport`` (tcp and the like); an
    shm transport, the segment ``like`` holds (another shm transport's: a tenant's, for one;
    the segment stays ``like``'s to unlink)."""
    try:
        if transport.kind == "shm" and like is not None and like.segment is not None:
            return SharedArena(transport.register_memory(like.segment))
        return SharedArena(transport.register_memory(store.tiers.glue.host_array))
    except transports.TransportError as exc:
        raise map_transport_error(exc, "registering the host arena") from exc
