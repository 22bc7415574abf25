"""What became of each key of a write."""

from __future__ import annotations

import enum


class StoreStatus(enum.Enum):
    """What became of one key of a write."""

    STORED = "stored"  # written whole: later reads find it (verified)
    PRESENT = "present"  # already on disk: nothing written
    BUSY = "busy"  # another write of the key is in flight: nothing written
    NO_ROOM = "no_room"  # no free slot (the caller evicts first): nothing written
    FAILED = "failed"  # the OS failed the write (EIO, ENOSPC, EFBIG, short): slot returned

    @property
    def held(self) -> bool:
        """Whether the key is on disk after the write."""
        return self in (StoreStatus.STORED, StoreStatus.PRESENT)
