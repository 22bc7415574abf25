"""Page checksums: the CRC-32C of each page whose content is final, kept beside the page table.

::

    append fills a page  -> seal: CRC-32C of the device page     (one native call per append)
    a peer's page lands  -> the peer's CRC, verified on arrival  (page server commit, a load)
    cold copy written    -> CRC-32C of the encoded payload, per cold slot
    every boundary       -> the bytes are checked against the CRC before anything reads them

One owner: :class:`PageSums`, held by the :class:`~tierkv.page_table.PageTable`, which drops a
page's checksum when the page leaves its last tier and moves it with a rename. A checksum is of
the page's raw bytes (one slot row of ``page_bytes``), whichever tier holds it; a cold copy,
encoded by a codec (lossy or not), carries a second checksum, of its encoded payload, checked
before it is decoded. Both live in containers the garbage collector neither tracks nor walks (a
dict of bytes -> int, an array of uint32): no object per page.

A page without a checksum (partial, still being appended to; or written on a CUDA device, whose
bytes are not read back at append) gets one the first time its bytes leave this process
(published to a peer or to Redis), computed from its host copy.

``TIERKV_PAGE_CHECKSUMS=0`` turns page checksums off (measurements only): nothing is computed,
nothing verified, and a peer that requires them counts our pages as corrupt.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from tierkv.transports.crc32c_native import crc32c_rows, native_crc32c

__all__ = ["NO_SUM", "PageCheck", "PageSums", "enabled", "row_sums"]

Key = Hashable
#: The value of "no checksum" in a list of checksums (a CRC-32C is below 2**32).
NO_SUM = -1


def enabled() -> bool:
    """Whether page checksums are computed and verified here: a CRC-32C implementation is
    available and ``TIERKV_PAGE_CHECKSUMS`` is not ``0``."""
    return os.environ.get("TIERKV_PAGE_CHECKSUMS", "1") != "0" and native_crc32c() is not None


def row_sums(rows: Any, slots: Sequence[int]) -> list[int]:
    """CRC-32C of ``rows[s]`` for each of ``slots`` (a ``[n, page_bytes]`` uint8 array), in one
    native call."""
    return crc32c_rows(rows, slots)


def valid_sum(value: object) -> bool:
    """Whether ``value`` is a CRC-32C (an int in [0, 2**32))."""
    return type(value) is int and 0 <= value < 1 << 32


class PageCheck:
    """What a page source reports about a load it verified: the checksum of each page it
    delivered (in order; checked against the one its peer declared) and how many pages it
    dropped as corrupt. Filled by the source, read by the store."""

    __slots__ = ("corrupt", "sums")

    def __init__(self) -> None:
        self.sums: list[int] = []
        self.corrupt = 0


class PageSums:
    """CRC-32C by page key (raw page bytes), plus per-slot checksums of encoded copies.

    Args:
        copy_slots: tier name -> slots, for tiers whose copies are encoded (cold): each slot
            keeps the checksum of the payload written there.
    """

    __slots__ = ("_copies", "_of")

    def __init__(self, copy_slots: Mapping[str, int] | None = None) -> None:
        self._of: dict[Key, int] = {}  # atomic keys, int values: untracked by the collector
        # per slot of an encoded tier: the payload's checksum, NO_SUM before one is written
        self._copies = {t: array("q", [NO_SUM]) * n for t, n in (copy_slots or {}).items()}

    def __len__(self) -> int:
        return len(self._of)

    def __contains__(self, key: Key) -> bool:
        return key in self._of

    def known_of(self, keys: Iterable[Key]) -> list[Key]:
        """The keys (in order) with a checksum (one C-speed pass)."""
        of = self._of
        return [k for k in keys if k in of]

    def known(self) -> list[Key]:
        """Every key with a checksum (for invariant checks)."""
        return list(self._of)

    def get(self, keys: Iterable[Key]) -> list[int]:
        """The checksum of each key, :data:`NO_SUM` where none is known."""
        get = self._of.get
        return [get(k, NO_SUM) for k in keys]

    def set(self, keys: Sequence[Key], sums: Sequence[int]) -> None:
        """Record the checksums of pages whose content is final."""
        self._of.update(zip(keys, sums))

    def pop(self, keys: Iterable[Key]) -> None:
        """Forget the checksums of ``keys`` (pages gone, or found corrupt)."""
        pop = self._of.pop
        for k in keys:
            pop(k, None)

    def rename(self, old: Sequence[Key], new: Sequence[Key]) -> None:
        """Pages renamed (private -> content): their checksums follow them."""
        of = self._of
        for o, n in zip(old, new):
            s = of.pop(o, None)
            if s is not None:
                of[n] = s

    def set_copies(self, tier: str, slots: Sequence[int], sums: Sequence[int]) -> None:
        """The checksums of the encoded payloads just written to ``slots`` of ``tier``."""
        arr = self._copies[tier]
        for s, c in zip(slots, sums):
            arr[s] = c

    def copies(self, tier: str, slots: Sequence[int]) -> list[int]:
        """The checksums recorded for ``slots`` of ``tier`` by :meth:`set_copies`."""
        arr = self._copies[tier]
        return [arr[s] for s in slots]
