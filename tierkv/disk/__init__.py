"""The disk medium: pages on local disk that survive restarts and are verified on every read.

See docs/disk.md for the on-disk format and the figures.
"""

from __future__ import annotations

from .errors import (
    DiskClosedError,
    DiskConfigError,
    DiskError,
    DiskForeignDirError,
    DiskInUseError,
    DiskLayoutError,
    DiskSpaceError,
)
from .index import Reserved
from .pages import DiskPages
from .stats import DiskStats, Histogram
from .status import StoreStatus

__all__ = [
    "DiskClosedError",
    "DiskConfigError",
    "DiskError",
    "DiskForeignDirError",
    "DiskInUseError",
    "DiskLayoutError",
    "DiskPages",
    "DiskSpaceError",
    "DiskStats",
    "Histogram",
    "Reserved",
    "StoreStatus",
]
