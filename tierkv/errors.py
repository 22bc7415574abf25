"""The error tree of tierkv's semantic layer.

::

    TierKVError
     ├── SpecError            (also ValueError)   an invalid KVSpec, tensor shape or dtype
     ├── PageTableError                           misuse of the page table; nothing was changed
     │    ├── UnknownPageError (also KeyError)    a key that the tier does not hold
     │    ├── PageStateError                      a page in the wrong state (double complete, ...)
     │    └── PinError                            unpinning a page that is not pinned
     ├── TierFullError                            no room: every page is pinned or moving
     ├── StoreClosedError                         use of a store after close()
     └── SequenceError (also KeyError)            an unknown or already released sequence

Errors raised by the runtime (``runtime.errors``) and the transports (``transports.errors``)
keep their own roots; the store maps them at its boundary with ``raise ... from exc``.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Root of every error raised by the ``tierkv`` package."""


class SpecError(TierKVError, ValueError):
    """An invalid :class:`~tierkv.spec.KVSpec`, or a tensor that does not match it."""


class PageTableError(TierKVError):
    """Misuse of the page table. The table is left exactly as it was."""


class UnknownPageError(PageTableError, KeyError):
    """A key that the named tier does not hold (or does not hold in a usable state)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown page"


class PageStateError(PageTableError):
    """A page is in the wrong state for the operation (for example a double complete)."""


class PinError(PageTableError):
    """A pin count would go negative: the page was not pinned."""


class TierFullError(TierKVError):
    """A tier has no room because every page in it is pinned or moving."""


class StoreClosedError(TierKVError):
    """The store was used after it was closed."""


class SequenceError(TierKVError, KeyError):
    """An unknown sequence id, or one that was already released."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown sequence"
