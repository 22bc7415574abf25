"""tierkv's runtime: device backends, memory arenas, streams and events, the transfer engine.

Mechanism only: it knows bytes, arenas and slots, never what a KV page means::

    from tierkv.runtime import get_backend, TransferEngine, Priority

    backend = get_backend("auto")
    host = backend.create_arena("host", slot_bytes=page_bytes, num_slots=n)
    async with TransferEngine(backend, max_inflight=4) as engine:
        handle = engine.submit(host, src_ids, device, dst_ids, priority=Priority.DEMAND)
        await handle
"""

from __future__ import annotations

from .arena import Arena
from .backend import DEFAULT_TIMEOUT_S, Backend, CopyInfo, Event, Stream
from .copy_kernels import DEFAULT_STAGING_BYTES
from .cpu_backend import CpuBackend
from .cpu_stream import CpuEvent, CpuStream
from .cuda_backend import CudaBackend, cuda_available
from .cuda_stream import ComputeStream, CudaEvent, CudaStream
from .errors import (
    ArenaError,
    ArenaFullError,
    ArenaMismatchError,
    BackendUnavailableError,
    DoubleFreeError,
    EngineClosedError,
    InvalidSlotError,
    RuntimeEngineError,
    SlotBusyError,
    SlotError,
    TransferCancelledError,
    TransferError,
    WaitTimeoutError,
)
from .freelist import SlotFreeList, SlotIds
from .loop import has_uvloop, new_event_loop, run
from .registry import available_backends, get_backend, register_backend
from .stats import EngineStats, Priority, TransferStats
from .transfer import TransferEngine, TransferHandle

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "Arena",
    "ArenaError",
    "ArenaFullError",
    "ArenaMismatchError",
    "Backend",
    "BackendUnavailableError",
    "ComputeStream",
    "CopyInfo",
    "CpuBackend",
    "CpuEvent",
    "CpuStream",
    "CudaBackend",
    "CudaEvent",
    "CudaStream",
    "DoubleFreeError",
    "EngineClosedError",
    "EngineStats",
    "Event",
    "InvalidSlotError",
    "Priority",
    "RuntimeEngineError",
    "SlotBusyError",
    "SlotError",
    "SlotFreeList",
    "SlotIds",
    "Stream",
    "TransferCancelledError",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferStats",
    "WaitTimeoutError",
    "available_backends",
    "cuda_available",
    "get_backend",
    "has_uvloop",
    "new_event_loop",
    "register_backend",
    "run",
]
