"""The index after a restart: a scan of every slot header, one segment per I/O thread.

A slot is recovered when its header is intact, fits this layout and is PERSISTENT; a key found
in two slots (an evicted copy not yet overwritten, and a newer write) keeps the higher
generation. Payloads are not read here: each is verified when it is first read.
"""

from __future__ import annotations

import functools

from .io import Scratch, SlotIO
from .layout import Geometry, Header
from .ops import IoPool


def recover(
    io: SlotIO, pool: IoPool, fds: list[int], g: Geometry
) -> tuple[list[tuple[bytes, int, int]], int, int]:
    """([(key, slot, generation)] oldest first, the next generation, damaged headers)."""

    def scan(seg: int, scratch: Scratch) -> tuple[list[tuple[Header, int]], int]:
        first, slots = seg * g.slots_per_segment, g.segment_slots(seg)
        return io.scan(fds[seg], first, slots, g.slot_bytes, scratch)

    jobs = [pool.call(functools.partial(scan, seg)) for seg in range(g.segments)]
    best: dict[bytes, tuple[int, int]] = {}  # key -> (generation, slot)
    top = damaged = 0
    for job in jobs:
        headers, bad = job.result()
        damaged += bad
        for h, slot in headers:
            top = max(top, h.generation)
            if not h.persistent:
                continue
            old = best.get(h.key)
            if old is None or h.generation > old[0]:
                best[h.key] = (h.generation, slot)
    found = sorted((gen, slot, key) for key, (gen, slot) in best.items())
    return [(k, s, gen) for gen, s, k in found], top + 1, damaged
