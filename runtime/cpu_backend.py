"""The cpu backend: host arenas, one worker thread per stream, one native call per batch copy.

On a machine without a GPU every tier is host memory, so its figures measure the runtime's own
overhead against memcpy, not PCIe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierkv.transports.errors import InvalidInputError

from .arena import Arena, allocate_host_buffer
from .backend import DEFAULT_TIMEOUT_S, Backend, CopyInfo
from .cpu_copy import KERNELS, copy_rows, native_kernel
from .cpu_stream import CpuStream
from .errors import ArenaError, ArenaMismatchError, EngineClosedError
from .freelist import SlotIds

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """Host-memory backend. `kernel` picks the copy kernel (`cpu_copy.KERNELS`).

    "auto" uses the native kernel (the extension built at install time) where it exists, numpy
    kernels otherwise; "native" raises ValueError here when it is not available.
    """

    name = "cpu"

    def __init__(
        self,
        *,
        huge_pages: bool = True,
        kernel: str = "auto",
        wait_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if kernel not in KERNELS:
            raise InvalidInputError(f"unknown copy kernel {kernel!r}")
        if kernel == "native" and native_kernel() is None:
            raise InvalidInputError(
                "the native copy kernel is not available (tierkv.runtime._copy was not built "
                "at install time, or TIERKV_NATIVE_KERNEL=0)"
            )
        self.huge_pages = huge_pages
        self.kernel = kernel
        self.wait_timeout = wait_timeout
        self._streams: list[CpuStream] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"CpuBackend(kernel={self.kernel!r}, streams={len(self._streams)})"

    def create_arena(
        self, name: str, slot_bytes: int, num_slots: int, *, kind: str = "device"
    ) -> Arena:
        if kind not in ("device", "pinned", "pageable"):
            raise ArenaError(f"arena {name!r}: unknown kind {kind!r} (device, pinned, pageable)")
        if not isinstance(slot_bytes, int) or not isinstance(num_slots, int):
            raise ArenaError(f"arena {name!r}: slot_bytes and num_slots must be ints")
        if slot_bytes <= 0 or num_slots <= 0:
            raise ArenaError(
                f"arena {name!r}: slot_bytes and num_slots must be > 0, "
                f"got {slot_bytes} and {num_slots}"
            )
        buf = allocate_host_buffer(slot_bytes * num_slots, huge_pages=self.huge_pages)
        return Arena(name, slot_bytes, num_slots, backend=self.name, buffer=buf)

    def create_stream(self, name: str) -> CpuStream:
        if self._closed:
            raise EngineClosedError("cpu backend is closed")
        stream = CpuStream(name, wait_timeout=self.wait_timeout)
        self._streams.append(stream)
        return stream

    def create_staging(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return np.zeros(nbytes, dtype=np.uint8)

    def copy_slots(
        self, src: Arena, src_ids: SlotIds, dst: Arena, dst_ids: SlotIds, staging: Any
    ) -> CopyInfo:
        if src.slot_bytes != dst.slot_bytes:
            raise ArenaMismatchError(
                f"slot sizes differ: {src.name!r} {src.slot_bytes} B, "
                f"{dst.name!r} {dst.slot_bytes} B"
            )
        runs, kernel = copy_rows(
            src.array, src_ids, dst.array, dst_ids, staging, kernel=self.kernel
        )
        return CopyInfo(runs=runs, kernel=kernel)

    def close(self) -> None:
        """Stop every stream this backend created (after their queued work). Idempotent."""
        self._closed = True
        for stream in self._streams:
            stream.close()
        self._streams.clear()
