"""The `Transport` base class: registered regions, peers, batch-first one-sided reads and writes.

A backend subclasses `Transport`, sets `kind` and `capabilities`, and implements `_transfer`
(move the bytes of a validated batch) plus whichever hooks it needs (`_start`, `_close`,
`_peer_fields`, `_add_peer`, `_prepare_region`, `_on_deregister`). Everything else (region
bookkeeping, validation, handles, deadlines, notifications, close) lives here::

    async with create("tcp", secret=b"...") as t:
        src = t.register_memory(bytearray(1 << 20))
        peer = await t.add_peer(metadata_from_the_other_side)
        h = t.read([TransferOp(src, 0, remote_desc, 0, 4096)], notify=b"done")
        await h
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import secrets
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, TypeVar

import msgpack

from .args import check_timeout
from .crc32c_native import native_crc32c
from .errors import (
    ClosedError,
    InvalidTypeError,
    PeerError,
    ProtocolError,
    RegionError,
    RemoteAccessError,
    TransferTimeoutError,
    TransportError,
)
from .fence import ReadGuard, WriteGuard
from .handle import BatchHandle
from .regions import Capabilities, Notification, Region, RegionDescriptor, TransferOp, as_byte_view
from .session import Limits, decode

METADATA_LIMITS = Limits(frame=1 << 20, array=256, map=64, str=1 << 16, bin=1 << 20)
"""Bounds of a peer's metadata (`add_peer`): bytes a peer controls."""

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_NOTIFY_BYTES", "Direction", "Transport"]

DEFAULT_TIMEOUT_S = 30.0
Direction = Literal["read", "write"]
_T = TypeVar("_T", bound="Transport")


#: the largest notification a transport sends (peers refuse larger ones)
MAX_NOTIFY_BYTES = 1 << 16


class Transport(abc.ABC):
    """Base class of every transport; an async context manager (`start` / `aclose`).

    `name` is this agent's name (unique among the peers that will meet); `timeout` bounds every
    transfer, connect and wait that does not take its own. Notifications nobody has read yet
    are bounded (`max_notifications`, `max_notification_bytes`); past either, one is dropped
    and counted (`notifications_dropped`) and the transport drops the sender's connection.
    """

    #: notifications (and their bytes) that may wait for `get_notification`
    max_notifications: ClassVar[int] = 4096
    max_notification_bytes: ClassVar[int] = 8 << 20

    kind: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities]

    def __init__(self, name: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name or f"{self.kind}-{os.getpid()}-{secrets.token_hex(4)}"
        self.timeout = check_timeout(timeout)
        self._regions: dict[int, Region] = {}
        self._region_ids = itertools.count(1)
        self._peers: dict[str, dict[str, Any]] = {}
        self._notifications: asyncio.Queue[Notification] = asyncio.Queue()
        self._notification_bytes = 0
        self.notifications_dropped = 0
        self._inflight: set[BatchHandle] = set()
        self.write_guard: WriteGuard | None = None
        self.read_guard: ReadGuard | None = None
        self._started = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self: _T) -> _T:
        """Start serving (idempotent). Raises ClosedError after `aclose()`."""
        self._check_open()
        if not self._started:
            await self._start()
            self._started = True
        return self

    async def aclose(self) -> None:
        """Cancel in-flight transfers, stop serving, drop peers and regions. Idempotent.

        Each wait is bounded by `timeout`: serving that does not stop within it (a handler
        that does not end) raises TransferTimeoutError, after the peers and regions were
        dropped all the same (nothing is left half-closed)."""
        if self._closed:
            return
        self._closed = True
        for h in list(self._inflight):
            h.cancel()
        try:
            if self._inflight:
                await asyncio.wait([h.task for h in self._inflight], timeout=self.timeout)
            closing = asyncio.ensure_future(self._close())
            await asyncio.wait([closing], timeout=self.timeout)
            if not closing.done():  # (not wait_for: it would wait for the cancel to land)
                closing.cancel()
                raise TransferTimeoutError(
                    f"{self.kind} transport {self.name!r}: serving did not stop within "
                    f"{self.timeout:g} s (its peers and regions dropped)"
                )
            closing.result()
        finally:
            for region in list(self._regions.values()):
                self._drop_region(region)
            self._peers.clear()

    async def __aenter__(self: _T) -> _T:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """True after `aclose()`."""
        return self._closed

    # -- memory ----------------------------------------------------------------------------

    def register_memory(self, buffer: Any, kind: str = "host") -> Region:
        """Register a writable, C-contiguous buffer; peers may target it through its descriptor.

        Raises RegionError for a bad buffer or a kind not in `capabilities.memory_kinds`.
        """
        self._check_open()
        if kind not in self.capabilities.memory_kinds:
            raise RegionError(f"{self.kind} transport does not register {kind!r} memory")
        rid = next(self._region_ids)
        view, handle = self._prepare_region(buffer, rid)
        desc = RegionDescriptor(self.name, rid, view.nbytes, kind, handle)
        region = Region(view, desc, self)
        self._regions[rid] = region
        return region

    def allocate(self, size: int, kind: str = "host") -> Region:
        """Allocate and register `size` bytes that peers can target (zeroed)."""
        return self.register_memory(bytearray(size), kind)

    def deregister(self, region: Region) -> None:
        """Forget a region; peers' later accesses to it are refused. The caller must not
        deregister a region an unfinished transfer uses. Raises RegionError if not ours."""
        if self._regions.get(region.region_id) is not region:
            raise RegionError(f"{region!r} is not registered with {self.name!r}")
        self._drop_region(region)

    def _drop_region(self, region: Region) -> None:
        del self._regions[region.region_id]
        self._on_deregister(region)
        with contextlib.suppress(BufferError):  # views the caller took from it stay valid
            region.view.release()

    def serve_view(self, region_id: int, offset: int, length: int) -> memoryview:
        """The bytes a peer asked for in one of our regions (bounds-checked). For transport
        implementations: serve a peer's one-sided read or write from it. Raises
        RemoteAccessError."""
        region = self._regions.get(region_id)
        if region is None:
            raise RemoteAccessError(f"agent {self.name!r} has no region {region_id}")
        if offset < 0 or length < 0 or offset + length > region.size:
            raise RemoteAccessError(
                f"[{offset}, {offset + length}) is outside region {region_id} of "
                f"{self.name!r} ({region.size} bytes)"
            )
        return region.view[offset : offset + length]

    # -- fencing peers' writes (fence.py) ----------------------------------------------------

    def guard_writes(self, guard: WriteGuard | None) -> None:
        """Ask ``guard(agent, region id, offset, length)`` before a peer's write lands in our
        memory; a refused write fails at the writer with RemoteAccessError. Only transports
        whose side receives the bytes can ask (tcp); the others ignore it (see
        `write_fence`)."""
        self.write_guard = guard

    def guard_reads(self, guard: ReadGuard | None) -> None:
        """Ask ``guard(agent, region id, offset, length)`` before a peer's read of our memory
        is served; a refused read fails at the reader with RemoteAccessError. Only transports
        whose side sends the bytes can ask (tcp); the others ignore it (a peer that maps our
        memory, shm, reads it whole)."""
        self.read_guard = guard

    def write_fence(self, agent: str | None) -> asyncio.Future[None] | None:
        """A future done once no write of ``agent`` (None: any peer) that was let into our
        memory before this call can still land, or None when this transport cannot tell (the
        peer's bytes land without us: only the writer's own word ends its write). Must be
        called from the event loop. This base: None."""
        return None

    # -- peers -------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's `add_peer` (exchange it out of band)."""
        self._check_open()
        info = {"transport": self.kind, "agent": self.name, **self._peer_fields()}
        return bytes(msgpack.packb(info))

    async def add_peer(self, metadata: bytes) -> str:
        """Know (and, for connected transports, connect to) the peer that produced `metadata`.

        Returns the peer's agent name. Raises PeerError (bad metadata, wrong transport,
        unreachable), AuthError, ClosedError.
        """
        self._check_open()
        try:
            info = decode(metadata, METADATA_LIMITS)
        except ProtocolError as exc:  # malformed, or over the limits (a hostile peer's bytes)
            raise PeerError("malformed peer metadata") from exc
        if not isinstance(info, dict) or not isinstance(info.get("agent"), str):
            raise PeerError("malformed peer metadata")
        if info.get("transport") != self.kind:
            raise PeerError(f"metadata is for transport {info.get('transport')!r}, not {self.kind}")
        await self._add_peer(info)
        self._peers[info["agent"]] = info
        return str(info["agent"])

    @property
    def peers(self) -> list[str]:
        """Names of the known peers."""
        return list(self._peers)

    # -- transfers ---------------------------------------------------------------------------

    def read(
        self, ops: Iterable[TransferOp], notify: bytes | None = None, *, checksums: bool = False
    ) -> BatchHandle:
        """Post a batch of one-sided reads (remote -> local). See `write`. With
        ``checksums``, the handle's ``sums`` get the CRC-32C of each op's bytes once they have
        landed: a backend that copies computes each right after its copy (shm: the bytes still
        in cache), the others over the local ranges once the batch is done. Raises
        TransportError where no CRC-32C implementation is available."""
        if checksums and native_crc32c() is None:
            raise TransportError("checksums=True: no CRC-32C implementation here")
        return self._post("read", ops, notify, checksums)

    def write(self, ops: Iterable[TransferOp], notify: bytes | None = None) -> BatchHandle:
        """Post a batch of one-sided writes (local -> remote); returns an awaitable handle.

        `notify`, if given, reaches every target peer (`get_notification`) only after all of this
        batch's bytes have landed. Raises at once: RegionError (a local range outside its
        region), RemoteAccessError (a remote range outside its descriptor), PeerError (unknown
        peer), ClosedError. Later failures surface from awaiting the handle.
        """
        return self._post("write", ops, notify)

    async def get_notification(self, timeout: float | None = None) -> Notification:
        """The next notification a peer sent us; raises TransferTimeoutError after `timeout`
        seconds (default: the transport's timeout)."""
        self._check_open()
        if not self._notifications.empty():
            note = self._notifications.get_nowait()
        else:
            limit = self.timeout if timeout is None else timeout
            try:
                note = await asyncio.wait_for(self._notifications.get(), limit)
            except TimeoutError:
                raise TransferTimeoutError(f"no notification within {limit:g} s") from None
        self._notification_bytes -= len(note.data)
        return note

    def deliver_notification(self, peer: str, data: bytes) -> bool:
        """Queue a notification from ``peer`` for :meth:`get_notification`. For transport
        implementations: call it when a peer's message arrives. Returns False (dropped, counted)
        when over the budget: the caller then drops the sender's connection."""
        if (
            self._notifications.qsize() >= self.max_notifications
            or self._notification_bytes + len(data) > self.max_notification_bytes
        ):
            self.notifications_dropped += 1
            return False
        self._notification_bytes += len(data)
        self._notifications.put_nowait(Notification(peer, data))
        return True

    def _post(
        self,
        direction: Direction,
        ops: Iterable[TransferOp],
        notify: bytes | None,
        checksums: bool = False,
    ) -> Any:
        self._check_open()
        if notify is not None and len(notify) > MAX_NOTIFY_BYTES:
            raise ProtocolError(f"a notification of {len(notify)} bytes (limit {MAX_NOTIFY_BYTES})")
        batch = list(ops)
        nbytes = 0
        for op in batch:
            self._validate(op)
            nbytes += op.length
        handle = BatchHandle(timeout=self.timeout, nbytes=nbytes, num_ops=len(batch))
        handle.want_sums = checksums
        task = asyncio.get_running_loop().create_task(
            self._guarded(direction, batch, notify, handle)
        )
        handle._start(task)
        self._inflight.add(handle)
        task.add_done_callback(lambda _: self._inflight.discard(handle))
        return handle

    def _validate(self, op: TransferOp) -> None:
        if not isinstance(op, tuple) or len(op) != 5:  # (an int was unpacked: TypeError)
            raise InvalidTypeError(f"a batch holds TransferOps, got {type(op).__name__}")
        local, lo, remote, ro, n = op
        if self._regions.get(local.region_id) is not local:
            raise RegionError(f"local {local!r} is not registered with {self.name!r}")
        if lo < 0 or n < 0 or lo + n > local.size:
            raise RegionError(f"local range [{lo}, {lo + n}) is outside {local!r}")
        if ro < 0 or ro + n > remote.size:
            raise RemoteAccessError(f"remote range [{ro}, {ro + n}) is outside {remote}")
        if remote.agent not in self._peers:
            raise PeerError(f"unknown peer {remote.agent!r} (add_peer its metadata first)")

    async def _guarded(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        try:
            await self._transfer(direction, ops, notify, handle)
            if handle.want_sums and handle.sums is None:  # over the bytes as they landed
                crc = native_crc32c()
                assert crc is not None  # (checked at post)
                handle.sums = [crc(_landed(op), 0) for op in ops]
        except asyncio.CancelledError:
            if handle.expired:
                raise TransferTimeoutError(
                    f"{direction} of {handle.nbytes} bytes not done after {self.timeout:g} s"
                ) from None
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"transport {self.name!r} is closed")

    # -- backend hooks -------------------------------------------------------------------------

    @abc.abstractmethod
    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        """Move the bytes of a validated batch, then send `notify` to each target peer."""

    async def _start(self) -> None:  # noqa: B027 - optional hook
        """Start serving (listen sockets etc.)."""

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Stop serving and drop connections."""

    def _peer_fields(self) -> dict[str, Any]:
        """Extra metadata fields (addresses) a peer needs to reach us."""
        return {}

    async def _add_peer(self, info: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Check / connect to a new peer. Raise PeerError if it cannot be used."""

    def _prepare_region(self, buffer: Any, region_id: int) -> tuple[memoryview, str]:
        """The flat byte view of a buffer being registered and its backend-specific
        `RegionDescriptor.handle`. Raises RegionError."""
        return as_byte_view(buffer), ""

    def _on_deregister(self, region: Region) -> None:  # noqa: B027 - optional hook
        """Release backend resources of a region being dropped."""


def _landed(op: TransferOp) -> memoryview:
    """The local bytes of ``op``."""
    return op.local.view[op.local_offset : op.local_offset + op.length]
