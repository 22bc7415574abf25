"""The runtime's error tree, drawn once.

Every error the runtime raises on purpose derives from `RuntimeEngineError`; lower-level failures
(a torch or numpy error inside a copy, a missing CUDA driver) are mapped at the boundary with
``raise ... from exc``. The tree hangs under the library's root, `TierKVError` (defined in the
lowest layer, ``tierkv.transports.errors``, and re-exported here and by ``tierkv.errors``)::

    TierKVError
    └── RuntimeEngineError
        ├── BackendUnavailableError      a backend (e.g. "cuda") cannot run on this machine
        │   └── UnknownBackendError      no backend of that name (also an `UnknownNameError`)
        ├── ArenaError                   arena misuse; nothing is changed when raised
        │   ├── PageLockError            host memory could not be page-locked (cudaHostRegister)
        │   ├── ArenaFullError           not enough free slots for allocate(n)
        │   ├── ArenaMismatchError       slot sizes / backends of two arenas do not match
        │   └── SlotError                a bad batch of slot ids
        │       ├── InvalidSlotError     out of range, duplicated, wrong dtype/shape, not allocated
        │       ├── DoubleFreeError      free() of a slot that is already free
        │       └── SlotBusyError        free() of a slot a stream is still reading or writing
        ├── TransferError                a copy failed (or a dependency of it failed)
        │   └── TransferCancelledError   dropped before it started (cancel() or close())
        ├── EngineClosedError            use of an engine or stream after close
        └── WaitTimeoutError             a bounded wait ran out (also a `TimeoutError`)
"""

from __future__ import annotations

from tierkv.transports.errors import TierKVError, UnknownNameError

__all__ = [
    "ArenaError",
    "ArenaFullError",
    "ArenaMismatchError",
    "BackendUnavailableError",
    "DoubleFreeError",
    "EngineClosedError",
    "InvalidSlotError",
    "PageLockError",
    "RuntimeEngineError",
    "SlotBusyError",
    "SlotError",
    "TierKVError",
    "TransferCancelledError",
    "TransferError",
    "UnknownBackendError",
    "WaitTimeoutError",
]


class RuntimeEngineError(TierKVError):
    """Root of every error raised by `runtime`."""


class BackendUnavailableError(RuntimeEngineError):
    """The requested device backend cannot run here (library or device missing)."""


class UnknownBackendError(BackendUnavailableError, UnknownNameError):
    """No backend is registered under that name."""


class ArenaError(RuntimeEngineError):
    """Misuse of a memory arena. The arena is unchanged when this is raised."""


class PageLockError(ArenaError):
    """Host memory could not be page-locked (cudaHostRegister failed). Named ``PinError`` in
    ``runtime.cuda_arena`` before; that name is a deprecated alias now (``tierkv.errors.PinError``
    is the page table's, a different error)."""


class ArenaFullError(ArenaError):
    """`Arena.allocate(n)` asked for more slots than are free."""

    def __init__(self, arena: str, requested: int, free: int, total: int) -> None:
        super().__init__(
            f"arena {arena!r}: asked for {requested} slots, {free} of {total} are free"
        )
        self.arena = arena
        self.requested = requested
        self.free = free
        self.total = total


class ArenaMismatchError(ArenaError):
    """Two arenas in one transfer differ in slot size or backend."""


class SlotError(ArenaError):
    """A batch of slot ids is not valid for the operation."""


class InvalidSlotError(SlotError):
    """Slot ids out of range, duplicated, of the wrong dtype/shape, or not allocated."""


class DoubleFreeError(SlotError):
    """`Arena.free()` of a slot that is already free."""


class SlotBusyError(SlotError):
    """`Arena.free()` of a slot that an unfinished transfer still reads or writes."""


class TransferError(RuntimeEngineError):
    """A batch copy failed, or an event it depended on failed."""


class TransferCancelledError(TransferError):
    """The transfer was dropped before any byte moved (by `cancel()` or engine close)."""


class EngineClosedError(RuntimeEngineError):
    """The engine or stream has been closed."""


class WaitTimeoutError(RuntimeEngineError, TimeoutError):
    """A bounded wait (event, transfer, close) ran out of time."""
