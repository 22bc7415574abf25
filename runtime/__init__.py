"""tierkv's runtime: device backends, memory arenas, streams and events, the transfer engine.

Mechanism only: it knows bytes, arenas and slots, never what a KV page means::

    from tierkv.runtime import create_backend, TransferEngine, Priority

    backend = create_backend("auto")
    host = backend.create_arena("host", slot_bytes=page_bytes, num_slots=n)
    async with TransferEngine(backend, max_inflight=4) as engine:
        handle = engine.submit(host, src_ids, device, dst_ids, priority=Priority.DEMAND)
        await handle
"""

from __future__ import annotations

from .arena import Arena
from .backend import DEFAULT_TIMEOUT_S, Backend, Event, Stream
from .cpu_backend import CpuBackend
from .cuda_backend import CudaBackend, cuda_available
from .errors import (
    ArenaError,
    ArenaFullError,
    BackendUnavailableError,
    EngineClosedError,
    RuntimeEngineError,
    TransferCancelledError,
    TransferError,
    WaitTimeoutError,
)
from .loop import new_event_loop, run
from .priority import Priority
from .registry import (
    BACKENDS,
    available_backends,
    create_backend,
    get_backend,
    register_backend,
)
from .stats import EngineStats, TransferStats
from .transfer import TransferEngine, TransferHandle

# What a user of the runtime needs (and what a new backend implements: Backend, Arena, Stream,
# Event). Streams and events of each backend, slot lists and the slot errors stay importable from
# their modules (cpu_stream, cuda_stream, freelist, errors).
__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "Arena",
    "ArenaError",
    "ArenaFullError",
    "Backend",
    "BackendUnavailableError",
    "CpuBackend",
    "CudaBackend",
    "EngineClosedError",
    "EngineStats",
    "Event",
    "Priority",
    "RuntimeEngineError",
    "Stream",
    "TransferCancelledError",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferStats",
    "WaitTimeoutError",
    "available_backends",
    "create_backend",
    "cuda_available",
    "get_backend",
    "new_event_loop",
    "register_backend",
    "run",
]
