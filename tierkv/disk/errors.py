"""The disk medium's errors, under the package's root :class:`~tierkv.errors.TierKVError`.

::

    TierKVError
     ├── DiskError                               anything the disk medium raises
     │    ├── DiskConfigError (InvalidInputError) bad configuration at open (a missing or
     │    │    │                                  read-only directory, ``disk_bytes`` below
     │    │    │                                  one slot...): nothing was created
     │    │    ├── DiskLayoutError                PATH holds segments of another layout
     │    │    └── DiskForeignDirError            PATH is a non-empty folder no disk tier made
     │    │                                       (``overwrite=True`` takes it over)
     │    ├── DiskInUseError                      another process (or handle) holds PATH
     │    ├── DiskSpaceError                      the segments cannot be preallocated
     │    │                                       (ENOSPC, EFBIG at open): nothing was kept
     │    └── DiskClosedError (StoreClosedError)  use after close()
     └── ...

A write that fails at run time (EIO, ENOSPC, EFBIG, a short write) raises nothing: its keys come
back as :attr:`~tierkv.disk.StoreStatus.FAILED`, counted in the statistics, their slots returned.
A read that fails verification is a counted miss, never an error.
"""

from __future__ import annotations

from tierkv.errors import InvalidInputError, StoreClosedError, TierKVError


class DiskError(TierKVError):
    """Root of the disk medium's errors."""


class DiskConfigError(DiskError, InvalidInputError):
    """A bad disk configuration, refused at open before anything was created."""


class DiskLayoutError(DiskConfigError):
    """PATH already holds disk pages of another layout (page size, key size or format)."""


class DiskForeignDirError(DiskConfigError):
    """PATH is a non-empty directory that is not a disk tier's (no lock or layout file, and
    files of other names): refused untouched unless the open is given ``overwrite=True``."""


class DiskInUseError(DiskError):
    """Another process (or another open handle) holds the lock of PATH."""


class DiskSpaceError(DiskError):
    """The segment files could not be preallocated; what this open created was removed."""


class DiskClosedError(DiskError, StoreClosedError):
    """The disk pages were used after close()."""
