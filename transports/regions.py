"""Registered memory, the descriptors peers target, and the records a transfer is made of.

A `Region` is local: a writable, C-contiguous buffer the transport may read and write. Its
`RegionDescriptor` is what a peer needs to target it, and survives msgpack::

    agent "prefill-0"          region 3 (size 1 MiB, kind "host", handle "tkv-9f2c...-3")
    ┌──────────────────────────────────────────────────────────────┐
    │            │<-- remote_offset  +  length -->│                 │
    └──────────────────────────────────────────────────────────────┘
                        ▲ one TransferOp moves these bytes to / from
    ┌─────────────────────────────┐
    │   │<-- local_offset ... -->│  local Region on the initiator
    └─────────────────────────────┘
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgpack

from .errors import ProtocolError, RegionError
from .session import Limits, decode

DESCRIPTOR_LIMITS = Limits(frame=1 << 16, array=16, map=16, str=4096, bin=4096)
"""Bounds of a packed region descriptor (`RegionDescriptor.unpack`): bytes a peer controls."""

__all__ = [
    "MEMORY_KINDS",
    "Capabilities",
    "Notification",
    "Region",
    "RegionDescriptor",
    "TransferOp",
]

MEMORY_KINDS = ("host", "pinned", "device")


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """What a peer needs to target a registered region. Serializable (`pack` / `unpack`).

    `handle` is backend-specific (the shm segment name; empty when not needed).
    """

    agent: str
    region_id: int
    size: int
    kind: str = "host"
    handle: str = ""

    def to_wire(self) -> list[Any]:
        """A msgpack-able list."""
        return [self.agent, self.region_id, self.size, self.kind, self.handle]

    @classmethod
    def from_wire(cls, obj: Any) -> RegionDescriptor:
        """Inverse of `to_wire`. Raises RegionError on a malformed value."""
        try:
            agent, region_id, size, kind, handle = obj
        except (TypeError, ValueError) as exc:
            raise RegionError(f"malformed region descriptor {obj!r}") from exc
        ok = isinstance(agent, str) and isinstance(kind, str) and isinstance(handle, str)
        if not ok or type(region_id) is not int or type(size) is not int or size < 0:
            raise RegionError(f"malformed region descriptor {obj!r}")
        return cls(agent, region_id, size, kind, handle)

    def pack(self) -> bytes:
        """msgpack bytes, for out-of-band exchange."""
        return bytes(msgpack.packb(self.to_wire()))

    @classmethod
    def unpack(cls, data: bytes) -> RegionDescriptor:
        """Inverse of `pack`. Raises RegionError on malformed bytes."""
        try:
            obj = decode(data, DESCRIPTOR_LIMITS)
        except ProtocolError as exc:  # malformed, or over the limits (a hostile peer's bytes)
            raise RegionError("malformed region descriptor bytes") from exc
        return cls.from_wire(obj)


class Region:
    """A registered local buffer: `view` (a flat writable byte memoryview) and its descriptor."""

    __slots__ = ("_owner", "descriptor", "view")

    def __init__(self, view: memoryview, descriptor: RegionDescriptor, owner: object) -> None:
        self.view = view
        self.descriptor = descriptor
        self._owner = owner

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self.descriptor.size

    @property
    def region_id(self) -> int:
        """The id its transport gave it."""
        return self.descriptor.region_id

    def __repr__(self) -> str:
        d = self.descriptor
        return f"Region(agent={d.agent!r}, id={d.region_id}, size={d.size}, kind={d.kind!r})"


def as_byte_view(buffer: Any) -> memoryview:
    """A flat, writable byte view of `buffer`. Raises RegionError if it is not one."""
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise RegionError(f"{type(buffer).__name__} does not support the buffer protocol") from exc
    if view.readonly:
        raise RegionError("registered memory must be writable")
    if not view.c_contiguous:
        raise RegionError("registered memory must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class TransferOp(NamedTuple):
    """One range of a batch: `length` bytes between a local region and a remote one."""

    local: Region
    local_offset: int
    remote: RegionDescriptor
    remote_offset: int
    length: int


def group_by_peer(ops: Iterable[TransferOp]) -> dict[str, list[TransferOp]]:
    """The ops of a batch grouped by the agent that owns their remote region, in order."""
    by_peer: dict[str, list[TransferOp]] = {}
    for op in ops:
        by_peer.setdefault(op.remote.agent, []).append(op)
    return by_peer


class Notification(NamedTuple):
    """A message a peer attached to a transfer, delivered after all its bytes landed."""

    peer: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do.

    memory_kinds: kinds `register_memory` accepts.
    one_sided:    "native" when the initiator moves the bytes itself (the target's CPU is not
                  involved per op), "emulated" when a server on the target serves each request.
    scope:        "process", "host" or "network": how far apart peers may be.
    """

    memory_kinds: frozenset[str]
    one_sided: Literal["native", "emulated"]
    scope: Literal["process", "host", "network"]
    notifications: bool = True
