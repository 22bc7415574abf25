"""CUDA IPC: share a device arena with another process on the same host, pages read in place.

    exporter process                              importer process
    ----------------                              ----------------
    exp = export_arena(dev, num_events=8)
    send(exp.descriptor)   --- pickle / pipe -->  arena = open_arena(desc)
    i = exp.record(stream)  (after writes)        arena.wait(i, stream)   device-side wait
    send(("ready", i, slot_ids))   ---------->    arena.array[slot_ids] / arena.tensor ...

The descriptor holds the cudaIpcMemHandle of the arena's cudaMalloc (so no pool block), the
slot geometry, and the handles of a ring of interprocess events (cudaEventInterprocess |
cudaEventDisableTiming). `record` reuses the ring round-robin: an index must be consumed (waited
on) by the importer before the exporter records `num_events` more, which the message protocol of
the caller guarantees (e.g. one outstanding notice per event). A handle cannot be opened in the
process that exported it (CUDA's rule); `open_arena` says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.transports.errors import InvalidInputError

from .cuda_arena import DeviceArena
from .cuda_env import import_cupy
from .errors import ArenaError, InvalidSlotError
from .freelist import as_slot_ids

__all__ = ["ArenaDescriptor", "ArenaExport", "ImportedArena", "export_arena", "open_arena"]


@dataclass(frozen=True, slots=True)
class ArenaDescriptor:
    """Everything another process needs to open an exported arena (picklable)."""

    pid: int
    device: int
    mem_handle: bytes
    offset: int  # of slot 0 from the start of the cudaMalloc (0 for a DeviceArena)
    nbytes: int
    slot_bytes: int
    num_slots: int
    event_handles: tuple[bytes, ...]

    def slot_offset(self, i: int) -> int:
        """Byte offset of slot `i` from the start of the shared allocation."""
        if not 0 <= i < self.num_slots:
            raise InvalidSlotError(f"slot {i} not in [0, {self.num_slots})")
        return self.offset + i * self.slot_bytes


class ArenaExport:
    """The exporting side: the descriptor, and the ring of interprocess events."""

    def __init__(self, arena: DeviceArena, num_events: int = 8) -> None:
        if num_events < 1:
            raise InvalidInputError(f"num_events must be >= 1, got {num_events}")
        cupy = import_cupy()
        rt = cupy.cuda.runtime
        self.arena = arena
        with cupy.cuda.Device(arena.device):
            self._events = [
                cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
                for _ in range(num_events)
            ]
            handles = tuple(rt.ipcGetEventHandle(e.ptr) for e in self._events)
            mem_handle = rt.ipcGetMemHandle(arena.ptr)
        self.descriptor = ArenaDescriptor(
            pid=os.getpid(),
            device=arena.device,
            mem_handle=mem_handle,
            offset=0,
            nbytes=arena.nbytes,
            slot_bytes=arena.slot_bytes,
            num_slots=arena.num_slots,
            event_handles=handles,
        )
        self._next = 0

    def record(self, stream: Any = None) -> int:
        """Record the next ring event on `stream` (a cupy stream, a `CudaStream` or a
        `ComputeStream`; default: CuPy's current stream) and return its index.
        """
        import cupy

        s = getattr(stream, "cuda", stream)
        if s is None:
            s = cupy.cuda.get_current_stream()
        i = self._next
        self._next = (i + 1) % len(self._events)
        with cupy.cuda.Device(self.arena.device):
            self._events[i].record(s)
        return i


def export_arena(arena: DeviceArena, num_events: int = 8) -> ArenaExport:
    """Export a device arena for other processes. Raises BackendUnavailableError, ArenaError."""
    if not isinstance(arena, DeviceArena):
        raise ArenaError(f"arena {arena.name!r}: only device arenas can be exported")
    return ArenaExport(arena, num_events)


class ImportedArena:
    """An exported arena opened in this process: `array` (cupy) and `tensor` (torch, DLPack)
    are views of the exporter's memory, [num_slots, slot_bytes]. Close it (or use `with`)."""

    def __init__(self, desc: ArenaDescriptor, device: int | None = None) -> None:
        cupy = import_cupy()
        rt = cupy.cuda.runtime
        if desc.pid == os.getpid():
            raise ArenaError(
                "a CUDA IPC handle cannot be opened by the process that exported it; "
                "use the arena directly"
            )
        self.descriptor = desc
        self.device = desc.device if device is None else device
        self.slot_bytes = desc.slot_bytes
        self.num_slots = desc.num_slots
        with cupy.cuda.Device(self.device):
            try:
                self._base = rt.ipcOpenMemHandle(desc.mem_handle)
            except Exception as exc:
                raise ArenaError(
                    f"cannot open the IPC handle of {desc.nbytes} B from pid {desc.pid}: {exc}"
                ) from exc
            self._events = [rt.ipcOpenEventHandle(h) for h in desc.event_handles]
            mem = cupy.cuda.UnownedMemory(self._base, desc.nbytes, self, self.device)
            self.array = cupy.ndarray(
                (desc.num_slots, desc.slot_bytes),
                dtype=cupy.uint8,
                memptr=cupy.cuda.MemoryPointer(mem, desc.offset),
            )
        self._tensor: torch.Tensor | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<ImportedArena from pid {self.descriptor.pid} device={self.device} "
            f"slots={self.num_slots}x{self.slot_bytes} B closed={self._closed}>"
        )

    @property
    def tensor(self) -> torch.Tensor:
        """The shared buffer as a torch cuda uint8 tensor (zero-copy, DLPack)."""
        if self._tensor is None:
            self._tensor = torch.from_dlpack(self.array)
        return self._tensor

    def slots(self, ids: object) -> Any:
        """A cupy copy of slots `ids` (gathered on the current stream). Raises InvalidSlotError."""
        import cupy

        arr = as_slot_ids(ids, self.num_slots, what="imported arena slots")
        return self.array[cupy.asarray(arr)]

    def wait(self, index: int, stream: Any = None) -> None:
        """Make later work on `stream` (default: CuPy's current) wait for exporter event `index`.
        Device-side; the host does not block.
        """
        import cupy

        s = getattr(stream, "cuda", stream)
        if s is None:
            s = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.streamWaitEvent(s.ptr, self._events[index], 0)

    def query(self, index: int) -> bool:
        """True when exporter event `index` has completed (never blocks)."""
        import cupy

        return int(cupy.cuda.runtime.eventQuery(self._events[index])) == 0

    def synchronize(self, index: int) -> None:
        """Block until exporter event `index` has completed (GIL released)."""
        import cupy

        cupy.cuda.runtime.eventSynchronize(self._events[index])

    def close(self) -> None:
        """Release the mapping and the events. Idempotent; drop views of `array` first."""
        if self._closed:
            return
        import cupy

        rt = cupy.cuda.runtime
        self._closed = True
        self._tensor = None
        self.array = None
        with cupy.cuda.Device(self.device):
            for ev in self._events:
                rt.eventDestroy(ev)
            rt.ipcCloseMemHandle(self._base)

    def __enter__(self) -> ImportedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_arena(desc: ArenaDescriptor, device: int | None = None) -> ImportedArena:
    """Open an arena exported by another process. Raises ArenaError, BackendUnavailableError."""
    return ImportedArena(desc, device)
