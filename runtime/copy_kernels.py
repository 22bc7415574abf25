"""Batch copy kernels for host arenas: one call moves a whole batch of slots.

Pairs are sorted by source id and cut into runs where both sides are adjacent::

    src ids  4 5 6 | 9 | 1 2      dst ids  10 11 12 | 3 | 7 8     ->  3 runs: one memcpy each

Few long runs are copied run by run (one memcpy per run). Scattered slots go through a staging
buffer small enough to stay in cache, a chunk at a time: numpy ``take`` gathers the chunk's source
rows into it, fancy assignment scatters them to the destination rows. Both loop in C with the GIL
released; the Python loop is per chunk or per run, never per slot.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .freelist import SlotIds

__all__ = ["DEFAULT_STAGING_BYTES", "coalesce_runs", "copy_rows"]

#: Default staging buffer size: large enough to amortize per-call cost, small enough for L2/L3.
DEFAULT_STAGING_BYTES = 2 << 20

# Runs shorter than this on average go through the staging path instead of one memcpy per run.
_RUN_MIN_BYTES = 192 << 10


def coalesce_runs(src_ids: SlotIds, dst_ids: SlotIds) -> tuple[SlotIds, SlotIds, SlotIds]:
    """Sort pairs by source id and merge adjacent pairs into runs.

    Returns (src_starts, dst_starts, lengths); copying run k means copying `lengths[k]` slots from
    `src_starts[k]` to `dst_starts[k]`.
    """
    n = src_ids.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(src_ids, kind="stable")
    s = src_ids[order]
    d = dst_ids[order]
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    lengths = np.diff(np.append(starts, n))
    return s[starts], d[starts], lengths


def copy_rows(
    src: npt.NDArray[np.uint8],
    src_ids: SlotIds,
    dst: npt.NDArray[np.uint8],
    dst_ids: SlotIds,
    staging: npt.NDArray[np.uint8],
    *,
    kernel: str = "auto",
) -> tuple[int, str]:
    """Copy rows `src[src_ids]` into `dst[dst_ids]` (2-D uint8 arrays of equal row size).

    `kernel` is "auto", "runs" or "staged". Ids must be valid and `dst_ids` unique (callers check).
    Returns (number of runs, kernel used).
    """
    row = src.shape[1]
    s0, d0, lengths = coalesce_runs(src_ids, dst_ids)
    nruns = int(lengths.size)
    if nruns == 0:
        return 0, "none"
    chunk = staging.size // row
    if kernel == "auto":
        long_runs = nruns == 1 or src_ids.size * row >= _RUN_MIN_BYTES * nruns
        kernel = "runs" if long_runs or chunk == 0 else "staged"
    if kernel == "runs":
        for s, d, n in zip(s0.tolist(), d0.tolist(), lengths.tolist()):
            np.copyto(dst[d : d + n], src[s : s + n])
        return nruns, "runs"
    if kernel != "staged":
        raise ValueError(f"unknown kernel {kernel!r}")
    if chunk == 0:
        raise ValueError(f"staging buffer ({staging.size} B) is smaller than one row ({row} B)")
    stage = staging[: chunk * row].reshape(chunk, row)
    for i in range(0, src_ids.size, chunk):
        s = src_ids[i : i + chunk]
        out = stage[: s.size]
        # mode="clip": ids are already checked; "raise" would buffer `out` in a temporary.
        np.take(src, s, axis=0, out=out, mode="clip")
        dst[dst_ids[i : i + chunk]] = out
    return nruns, "staged"
