"""Memory arenas: one large buffer per tier, carved into fixed-size slots.

    buffer  [ slot 0 | slot 1 | slot 2 | ... | slot n-1 ]      n = num_slots
             <------> slot_bytes              nbytes = n * slot_bytes
    slot i  = buffer[i * slot_bytes : (i + 1) * slot_bytes]

An arena knows bytes and slots, never what a slot holds. Ownership of a slot stays with whoever
allocated it; a slot that an unfinished transfer still reads or writes is *busy* and cannot be
freed (SlotBusyError), so a cancelled await can never hand a half-written slot to someone else.

A budget is a limit, not an allocation: host buffers reserve address space only (an anonymous
mapping with MAP_NORESERVE, never touched here), and the kernel commits a page of memory when
it is first written. An arena of 64 GiB on a 24 GiB machine maps at once and costs the RSS of
the slots actually used; touching more than the machine holds is then the caller's out-of-memory
(with ``vm.overcommit_memory=2`` the kernel refuses the reservation itself, and the ArenaError
says so).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import platform
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import ArenaError, InvalidSlotError, SlotBusyError
from .freelist import SlotFreeList, SlotIds, as_slot_ids

__all__ = ["MAP_NORESERVE", "Arena", "allocate_host_buffer", "check_slots"]


def _map_noreserve() -> int:
    # Python exposes MAP_NORESERVE only from 3.13; its value on Linux depends on the architecture.
    flag = getattr(mmap, "MAP_NORESERVE", None)
    if flag is not None:
        return int(flag)
    if not sys.platform.startswith("linux"):
        return 0
    machine = platform.machine().lower()
    for prefix, value in (("ppc", 0x40), ("sparc", 0x40), ("mips", 0x400), ("alpha", 0x10000)):
        if machine.startswith(prefix):
            return value
    return 0x4000  # x86, arm, arm64, riscv, s390, loongarch


MAP_NORESERVE = _map_noreserve()


def _overcommit_mode() -> str:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def allocate_host_buffer(nbytes: int, *, huge_pages: bool = True) -> npt.NDArray[np.uint8]:
    """An anonymous, page-aligned, zero-filled host buffer of `nbytes`, committed lazily.

    Only address space is reserved (MAP_NORESERVE, nothing touched): the kernel commits each
    page of memory when it is first written, so the RSS of a buffer is what has been used of
    it, whatever its size. Transparent huge pages are requested where the OS offers them
    (fewer TLB misses on random slot access). Raises ArenaError when the address space cannot
    be reserved (the message names the overcommit mode when the kernel refused).
    """
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError, OverflowError) as exc:
        hint = ""
        if isinstance(exc, OSError) and exc.errno == 12:
            hint = (
                f" (vm.overcommit_memory={_overcommit_mode()}; mode 2 commits every mapping "
                "up front: lower the budget or allow overcommit)"
            )
        raise ArenaError(f"cannot map {nbytes} bytes of host memory: {exc}{hint}") from exc
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # advisory only
            mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8)


class _Populate:
    """``madvise(MADV_POPULATE_WRITE)`` through ctypes, which releases the GIL for the call
    (``mmap.madvise`` holds it): Linux 5.14 and later; disabled after the first refusal."""

    ADVICE = 23  # MADV_POPULATE_WRITE (linux/mman.h)

    def __init__(self) -> None:
        self.usable = sys.platform.startswith("linux")
        self._madvise: Any = None

    def run(self, addr: int, length: int) -> bool:
        if self._madvise is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.madvise
            except (OSError, AttributeError):
                self.usable = False
                return False
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            self._madvise = fn
        if self._madvise(addr, length, self.ADVICE) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:  # an older kernel: no such advice
            self.usable = False
        return False


_POPULATE = _Populate()


def check_slots(name: str, slot_bytes: int, num_slots: int) -> None:
    """Raise ArenaError unless an arena of ``num_slots`` slots of ``slot_bytes`` can exist."""
    if slot_bytes <= 0 or num_slots <= 0:
        raise ArenaError(
            f"arena {name!r}: slot_bytes and num_slots must be > 0, "
            f"got {slot_bytes} and {num_slots}"
        )


class Arena:
    """A buffer of `num_slots` slots of `slot_bytes` bytes each, with an O(1) slot free list.

    Thread-safe: allocation, free and the busy counts are guarded by one lock.

    An owner that keeps its own slot bookkeeping (the KV store's page table, whose page states
    already say which slot a copy reads or writes) calls :meth:`hand_over` once: from then on
    the arena keeps no free list and no busy counts, so slots and in-flight state are kept in
    one place, the owner's.
    """

    _handed_over = False  # class default: subclasses that init slots themselves inherit it

    def __init__(
        self,
        name: str,
        slot_bytes: int,
        num_slots: int,
        *,
        backend: str,
        buffer: npt.NDArray[np.uint8],
    ) -> None:
        check_slots(name, slot_bytes, num_slots)
        if buffer.dtype != np.uint8 or buffer.size != slot_bytes * num_slots:
            raise ArenaError(
                f"arena {name!r}: buffer must be uint8 of {slot_bytes * num_slots} bytes, "
                f"got {buffer.dtype} of {buffer.size}"
            )
        self._init_slots(name, slot_bytes, num_slots, backend)
        self._array: npt.NDArray[np.uint8] = buffer.reshape(num_slots, slot_bytes)
        self._tensor = torch.from_numpy(self._array)

    def _init_slots(self, name: str, slot_bytes: int, num_slots: int, backend: str) -> None:
        """The bookkeeping half of the constructor: names, sizes, the free list, the busy
        counts and their lock. Subclasses whose buffer is not a host array (device memory)
        call it instead of ``__init__``. Raises ArenaError for sizes that are not > 0."""
        check_slots(name, slot_bytes, num_slots)
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.backend = backend
        self._free = SlotFreeList(num_slots, name)
        self._busy = np.zeros(num_slots, dtype=np.int32)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"Arena({self.name!r}, backend={self.backend!r}, slot_bytes={self.slot_bytes}, "
            f"num_slots={self.num_slots}, free={self.num_free})"
        )

    @property
    def nbytes(self) -> int:
        """Total size of the buffer in bytes."""
        return self.slot_bytes * self.num_slots

    @property
    def num_free(self) -> int:
        """Number of free slots (0 once handed over: the owner holds them all)."""
        return 0 if self._handed_over else self._free.num_free

    @property
    def num_used(self) -> int:
        """Number of allocated slots (all of them once handed over)."""
        return self.num_slots - self.num_free

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor of shape [num_slots, slot_bytes] (zero-copy)."""
        return self._tensor

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole buffer as a uint8 numpy array of shape [num_slots, slot_bytes] (zero-copy)."""
        return self._array

    @property
    def handed_over(self) -> bool:
        """True once :meth:`hand_over` gave the slot bookkeeping to the arena's owner."""
        return self._handed_over

    def hand_over(self) -> None:
        """Give every slot, and the bookkeeping of which are in use or in flight, to the
        caller: allocate / free raise ArenaError from now on, and transfers no longer count
        busy slots (the owner must never reuse a slot a transfer still uses). Raises
        ArenaError when some slot is already allocated or busy. Idempotent."""
        with self._lock:
            if self._handed_over:
                return
            if self._free.num_free != self.num_slots or self._busy.any():
                raise ArenaError(f"arena {self.name!r}: cannot hand over slots already in use")
            self._handed_over = True

    def _own_slots(self, what: str) -> None:
        if self._handed_over:
            raise ArenaError(f"arena {self.name!r}: {what}: its slots were handed over")

    def allocate(self, n: int) -> SlotIds:
        """Allocate `n` slots and return their ids (int64, ascending runs where possible).

        Raises ArenaFullError when fewer than `n` slots are free; nothing is allocated then;
        ArenaError when the slots were handed over (:meth:`hand_over`).
        """
        with self._lock:
            self._own_slots("allocate")
            return self._free.allocate(n)

    def free(self, ids: object) -> None:
        """Return slots to the free list.

        Raises InvalidSlotError (bad ids), DoubleFreeError (already free) or SlotBusyError
        (an unfinished transfer still uses one), ArenaError when the slots were handed over;
        in every case nothing is freed.
        """
        arr = as_slot_ids(ids, self.num_slots, what=f"arena {self.name!r} free")
        with self._lock:
            self._own_slots("free")
            busy = self._busy[arr]
            if busy.any():
                raise SlotBusyError(
                    f"arena {self.name!r}: slots still in flight: {arr[busy > 0][:8].tolist()}"
                )
            self._free.free(arr)

    def prefault(self, first: int, n: int) -> bool:
        """Commit the memory of slots ``[first, first + n)`` now, without changing a byte of
        them (Linux ``MADV_POPULATE_WRITE``, called with the GIL released): the first write to
        those slots then takes no page fault. A transparent huge page's first fault zeroes
        2 MB and may compact memory first, ~1-5 ms on a busy machine; taken by an append on the
        event loop's thread, that is a loop stall. Safe while other threads read and write the
        slots. Best effort: returns False (and does nothing) where the kernel or platform
        cannot, or the range is empty.
        """
        first, end = max(0, int(first)), min(self.num_slots, int(first) + int(n))
        if end <= first or not _POPULATE.usable:
            return False
        base = int(self._array.ctypes.data)
        start = (base + first * self.slot_bytes) & ~(mmap.PAGESIZE - 1)
        stop = base + end * self.slot_bytes
        return _POPULATE.run(start, stop - start)

    def slot_view(self, i: int) -> torch.Tensor:
        """Slot `i` as a uint8 tensor of shape [slot_bytes] (zero-copy).

        Raises InvalidSlotError when `i` is out of range.
        """
        if not 0 <= int(i) < self.num_slots:
            raise InvalidSlotError(f"arena {self.name!r}: slot {i} not in [0, {self.num_slots})")
        return self._tensor[int(i)]

    def view(self, ids: object) -> torch.Tensor:
        """A copy of slots `ids` gathered into a new uint8 tensor [len(ids), slot_bytes].

        Raises InvalidSlotError for bad ids.
        """
        arr = as_slot_ids(ids, self.num_slots, what=f"arena {self.name!r} view")
        return self._tensor.index_select(0, torch.from_numpy(arr))

    def is_allocated(self, ids: object) -> bool:
        """True when every id is currently allocated (every slot of an arena whose slots were
        handed over). Raises InvalidSlotError for bad ids."""
        arr = as_slot_ids(ids, self.num_slots, what=f"arena {self.name!r}")
        with self._lock:
            return self._handed_over or self._free.is_allocated(arr)

    def is_busy(self, ids: object) -> bool:
        """True when any id is used by an unfinished transfer."""
        arr = as_slot_ids(ids, self.num_slots, what=f"arena {self.name!r}")
        with self._lock:
            return bool(self._busy[arr].any())

    # Engine side: pin slots for the duration of a transfer.

    def pin_for_transfer(self, ids: SlotIds, what: str) -> None:
        """Mark `ids` busy; they must be allocated. Raises InvalidSlotError otherwise.
        Nothing to do for handed-over slots: their owner tracks what is in flight."""
        if self._handed_over:
            return
        with self._lock:
            if not self._free.is_allocated(ids):
                state = self._free.allocated_mask()[ids]
                raise InvalidSlotError(
                    f"arena {self.name!r} {what}: slots not allocated: {ids[~state][:8].tolist()}"
                )
            self._busy[ids] += 1

    def unpin_after_transfer(self, ids: SlotIds) -> None:
        if self._handed_over:
            return
        with self._lock:
            self._busy[ids] -= 1
