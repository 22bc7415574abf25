"""Admission to the disk tier: write a page only the second time it is offered.

Dynamo's disk tier (KVBM G3) offloads a block only once it has been seen twice; `SeenTwice` is
that rule for the pages the host tier evicts. A key offered for the first time is remembered
and refused; offered again while still remembered, it is admitted. What it remembers is
bounded: two generations of a Bloom filter (3 positions from a BLAKE2b digest of the key), each
taking ``memory // 2`` keys before the older is dropped, so the keys of
about the last `memory` distinct offers are known, in ``10 * memory`` bits (5 MB for four
million keys) whatever the key count. A false positive (about 1% of the new keys) admits a page
on its first offer, as the tier without a filter would.

Off by default: on the Mooncake conversation trace it cuts what is written to disk by 4-8x but
lowers the hit rate at every size measured but the smallest (docs/disk.md, "Admission",
measured by ``benchmarks/disk_admission.py``).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

from tierkv.errors import InvalidInputError

__all__ = ["SeenTwice"]

_BITS_PER_KEY = 10
_HASHES = 3


class _Bloom:
    """A Bloom filter of `bits` bits (a bytearray), `_HASHES` positions per key."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.array = bytearray(-(-bits // 8))
        self.added = 0

    def has(self, where: list[int]) -> bool:
        a = self.array
        return all(a[i >> 3] >> (i & 7) & 1 for i in where)

    def add(self, where: list[int]) -> None:
        a = self.array
        for i in where:
            a[i >> 3] |= 1 << (i & 7)
        self.added += 1

    def clear(self) -> None:
        self.array[:] = bytes(len(self.array))
        self.added = 0


class SeenTwice:
    """Admit a key on its second offer among about the last `memory` distinct keys offered.

    Thread-safe. ``admit(keys)`` records the offers and says, per key, whether to write it;
    a key twice in one call is admitted the second time.
    """

    def __init__(self, memory: int) -> None:
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 2:
            raise InvalidInputError(f"admission memory must be an int >= 2, got {memory!r}")
        self.memory = memory
        self._per_generation = memory // 2
        bits = max(64, self._per_generation * _BITS_PER_KEY)
        self._lock = threading.Lock()
        self._new, self._old = _Bloom(bits), _Bloom(bits)
        self.admitted = 0
        self.refused = 0

    def _where(self, key: bytes) -> list[int]:
        if not isinstance(key, bytes) or not key:
            raise InvalidInputError(f"an admission key must be non-empty bytes, got {key!r:.60}")
        d = hashlib.blake2b(key, digest_size=8 * _HASHES).digest()
        bits = self._new.bits
        return [int.from_bytes(d[8 * i : 8 * i + 8], "little") % bits for i in range(_HASHES)]

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it was offered before (and is still remembered): write it. Every
        key is remembered from now on. Raises InvalidInputError for a key that is not
        non-empty bytes (nothing recorded then)."""
        where = [self._where(k) for k in keys]
        out: list[bool] = []
        with self._lock:
            for w in where:
                fresh = not self._new.has(w)
                out.append(not fresh or self._old.has(w))
                if fresh:
                    if self._new.added >= self._per_generation:  # forget the older half
                        self._old, self._new = self._new, self._old
                        self._new.clear()
                    self._new.add(w)
            n = sum(out)
            self.admitted += n
            self.refused += len(out) - n
        return out

    def stats(self) -> dict[str, int]:
        """Offers admitted and refused so far, and the memory bound."""
        with self._lock:
            return {"admitted": self.admitted, "refused": self.refused, "memory": self.memory}
