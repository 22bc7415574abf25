"""Arenas of the cuda backend: one cudaMalloc per device tier, and pinned host memory.

DeviceArena      cupy.cuda.Memory (a plain cudaMalloc, not a pool block, so it can be
                 exported over CUDA IPC); `array` is a cupy view, `tensor` a torch view
                 through DLPack (no copy), so attention reads pages in place.
HostArena        one contiguous host mapping; when pinned, registered with
                 cudaHostRegister (portable | mapped) lazily, chunk by chunk, on first use:

    buffer  [ chunk 0: slots 0..k-1 | chunk 1: slots k..2k-1 | ... ]   k = chunk_bytes // slot
              registered on the first copy that touches it (or by pin_all()); a slot never
              straddles two chunks, and copy runs are cut at chunk edges.

                 `HostArena.register(buffer)` wraps an existing buffer (numpy or torch cpu)
                 the same way. A failure to pin says how much was asked and how much is
                 pinned, in this arena and in the process.
"""

from __future__ import annotations

import mmap
import resource
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tierkv.transports.deprecation import warn_renamed

from .arena import MAP_NORESERVE, Arena, check_slots
from .errors import ArenaError, PageLockError
from .freelist import as_slot_ids

__all__ = ["DEFAULT_CHUNK_BYTES", "DeviceArena", "HostArena", "PageLockError", "pinned_bytes"]

#: Default size of one lazily pinned host chunk.
DEFAULT_CHUNK_BYTES = 1 << 30

# cudaHostRegisterPortable | cudaHostRegisterMapped
_REGISTER_FLAGS = 0x01 | 0x02

_pinned_lock = threading.Lock()
_pinned_total = 0


def pinned_bytes() -> int:
    """Bytes this process has pinned through cuda arenas."""
    return _pinned_total


def _memlock_limit() -> str:
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} B"


class DeviceArena(Arena):
    """A device-memory arena: one cudaMalloc of `slot_bytes * num_slots`, zeroed up front.

    Raises ArenaError (with the device's free memory) when the allocation fails.
    """

    kind = "device"

    def __init__(
        self, name: str, slot_bytes: int, num_slots: int, *, device: int, backend: str = "cuda"
    ) -> None:
        self._init_slots(name, slot_bytes, num_slots, backend)  # checks the sizes first
        import cupy

        nbytes = slot_bytes * num_slots
        with cupy.cuda.Device(device):
            try:
                mem = cupy.cuda.Memory(nbytes)
            except Exception as exc:  # OutOfMemoryError or CUDARuntimeError
                try:
                    free, total = cupy.cuda.runtime.memGetInfo()
                    have = f"device {device} has {free} of {total} B free"
                except Exception:
                    have = f"device {device} free memory unknown"
                raise ArenaError(
                    f"arena {name!r}: cudaMalloc of {nbytes} B failed ({exc}); {have}"
                ) from exc
            cupy.cuda.runtime.memset(mem.ptr, 0, nbytes)  # touch it now, not on first use
        self.device = device
        self._mem = mem
        self._cupy_array = cupy.ndarray(
            (num_slots, slot_bytes), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)
        )
        self._torch_view: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"DeviceArena({self.name!r}, device={self.device}, slot_bytes={self.slot_bytes}, "
            f"num_slots={self.num_slots}, free={self.num_free})"
        )

    @property
    def ptr(self) -> int:
        """Device address of slot 0."""
        return int(self._mem.ptr)

    @property
    def memory(self) -> Any:
        """The `cupy.cuda.Memory` that owns the buffer."""
        return self._mem

    @property
    def array(self) -> Any:
        """The buffer as a cupy uint8 array [num_slots, slot_bytes] (zero-copy)."""
        return self._cupy_array

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a torch cuda uint8 tensor [num_slots, slot_bytes], through DLPack."""
        if self._torch_view is None:
            self._torch_view = torch.from_dlpack(self._cupy_array)
        return self._torch_view

    def prefault(self, first: int, n: int) -> bool:
        """Device memory is committed (and zeroed) when the arena is made: nothing to do."""
        return False

    def slot_view(self, i: int) -> torch.Tensor:
        """Slot `i` as a torch cuda tensor [slot_bytes] (zero-copy). Raises InvalidSlotError."""
        as_slot_ids([int(i)], self.num_slots, what=f"arena {self.name!r} slot")
        return self.tensor[int(i)]

    def view(self, ids: object) -> torch.Tensor:
        """A copy of slots `ids` gathered into a new cuda tensor. Raises InvalidSlotError."""
        arr = as_slot_ids(ids, self.num_slots, what=f"arena {self.name!r} view")
        index = torch.from_numpy(arr).to(self.tensor.device)
        return self.tensor.index_select(0, index)

    def slot_address(self, i: int) -> int:
        """Device address of slot `i`."""
        return self.ptr + int(i) * self.slot_bytes


def _host_mapping(nbytes: int, name: str) -> npt.NDArray[np.uint8]:
    # Address space only (MAP_NORESERVE, see arena.py): pages are committed when a chunk is
    # registered (or first written), so a host budget above physical memory still maps.
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError, OverflowError) as exc:
        raise ArenaError(f"arena {name!r}: cannot map {nbytes} B of host memory: {exc}") from exc
    return np.frombuffer(mm, dtype=np.uint8)


class HostArena(Arena):
    """A host arena for the cuda backend; pinned lazily in chunks unless `pinned=False`.

    `chunk_bytes` is rounded down to whole slots (at least one slot per chunk).
    """

    def __init__(
        self,
        name: str,
        slot_bytes: int,
        num_slots: int,
        *,
        pinned: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        buffer: npt.NDArray[np.uint8] | None = None,
        backend: str = "cuda",
    ) -> None:
        check_slots(name, slot_bytes, num_slots)
        if buffer is None:
            buffer = _host_mapping(slot_bytes * num_slots, name)
        super().__init__(name, slot_bytes, num_slots, backend=backend, buffer=buffer)
        self.kind = "pinned" if pinned else "pageable"
        self.chunk_slots = max(1, chunk_bytes // slot_bytes)
        n_chunks = -(-num_slots // self.chunk_slots)
        self._registered = np.zeros(n_chunks, dtype=bool)
        self._pin_lock = threading.Lock()
        self._closed = False

    @classmethod
    def register(
        cls,
        name: str,
        buffer: Any,
        slot_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backend: str = "cuda",
    ) -> HostArena:
        """Wrap an existing host buffer (numpy array or torch cpu tensor, C-contiguous, a whole
        number of slots) as a pinned arena; it is registered with cudaHostRegister chunk by
        chunk on first use. The caller keeps the buffer alive. Raises ArenaError.
        """
        if isinstance(buffer, torch.Tensor):
            if buffer.device.type != "cpu" or not buffer.is_contiguous():
                raise ArenaError(f"arena {name!r}: need a contiguous cpu tensor")
            arr = buffer.view(torch.uint8).reshape(-1).numpy()
        else:
            arr = np.asarray(buffer)
            if not arr.flags.c_contiguous:
                raise ArenaError(f"arena {name!r}: the buffer must be C-contiguous")
            arr = arr.reshape(-1).view(np.uint8)
        if slot_bytes <= 0 or arr.size == 0 or arr.size % slot_bytes:
            raise ArenaError(
                f"arena {name!r}: buffer of {arr.size} B is not a whole number of "
                f"{slot_bytes} B slots"
            )
        return cls(
            name,
            slot_bytes,
            arr.size // slot_bytes,
            chunk_bytes=chunk_bytes,
            buffer=arr,
            backend=backend,
        )

    def __repr__(self) -> str:
        return (
            f"HostArena({self.name!r}, {self.kind}, slot_bytes={self.slot_bytes}, "
            f"num_slots={self.num_slots}, pinned={self.pinned_nbytes} B, free={self.num_free})"
        )

    @property
    def ptr(self) -> int:
        """Host address of slot 0 (also its device address once pinned: mapped, UVA)."""
        return int(self.array.ctypes.data)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of this arena registered so far."""
        return sum(self._chunk_range(int(c))[1] for c in np.flatnonzero(self._registered))

    def _chunk_range(self, c: int) -> tuple[int, int]:
        first = c * self.chunk_slots
        count = min(self.chunk_slots, self.num_slots - first)
        return first * self.slot_bytes, count * self.slot_bytes

    def ensure_pinned(self, ids: npt.NDArray[np.int64]) -> None:
        """Register the chunks holding `ids` that are not registered yet. Raises PageLockError."""
        if self.kind != "pinned" or ids.size == 0:
            return
        chunks = np.unique(ids // self.chunk_slots)
        if self._registered[chunks].all():
            return
        self._pin(chunks[~self._registered[chunks]])

    def pin_all(self) -> None:
        """Register every chunk now (instead of on first use). Raises PageLockError."""
        if self.kind == "pinned":
            self._pin(np.flatnonzero(~self._registered))

    def _pin(self, chunks: npt.NDArray[np.int64]) -> None:
        global _pinned_total
        from cupy.cuda import runtime

        with self._pin_lock:
            if self._closed:
                raise ArenaError(f"arena {self.name!r} is closed")
            for c in chunks.tolist():
                if self._registered[c]:
                    continue
                offset, nbytes = self._chunk_range(c)
                try:
                    runtime.hostRegister(self.ptr + offset, nbytes, _REGISTER_FLAGS)
                except Exception as exc:
                    raise PageLockError(
                        f"arena {self.name!r}: cannot pin {nbytes} B (chunk {c} of "
                        f"{self._registered.size}): {exc}; pinned now: {self.pinned_nbytes} of "
                        f"{self.nbytes} B in this arena, {_pinned_total} B in this process; "
                        f"RLIMIT_MEMLOCK {_memlock_limit()}"
                    ) from exc
                self._registered[c] = True
                with _pinned_lock:
                    _pinned_total += nbytes

    def close(self) -> None:
        """Unregister every pinned chunk. Idempotent; no copy may be in flight."""
        global _pinned_total
        with self._pin_lock:
            if self._closed:
                return
            self._closed = True
            if not self._registered.any():
                return
            from cupy.cuda import runtime

            for c in np.flatnonzero(self._registered).tolist():
                offset, nbytes = self._chunk_range(c)
                runtime.hostUnregister(self.ptr + offset)
                self._registered[c] = False
                with _pinned_lock:
                    _pinned_total -= nbytes


def __getattr__(name: str) -> Any:
    # PinError was this module's name of PageLockError (the page table's PinError is another
    # error): kept as a deprecated alias
    if name == "PinError":
        warn_renamed("tierkv.runtime.cuda_arena.PinError", "PageLockError")
        return PageLockError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
