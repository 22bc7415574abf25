"""Batch copy kernels for host arenas: one call moves a whole batch of slots.

Pairs are cut into runs where both sides are adjacent (in the caller's order)::

    src ids  4 5 6 | 9 | 1 2      dst ids  10 11 12 | 3 | 7 8     ->  3 runs

Kernels (`copy_rows(kernel=...)`):

- ``native``: one C call per batch, a loop of one ``memmove`` per run (GIL released). numpy and
  torch have no single-pass gather-to-scatter copy (fancy indexing on both sides goes through a
  temporary), and a Python loop of memmoves costs ~1 us a call, a third of a 16 KB copy. The C
  loop is six lines, compiled with the system C compiler on first use and cached (see
  `native_kernel`); where that fails, "auto" falls back to the numpy kernels below.
- ``runs``: one numpy copy per run (Python loop per run; fine when runs are long).
- ``staged``: a chunk at a time through a staging buffer kept at most L2-sized: numpy ``take``
  gathers the chunk's source rows, fancy assignment scatters them (C loops, GIL released).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.transports.native_build import build_library

from .freelist import SlotIds

__all__ = ["DEFAULT_STAGING_BYTES", "KERNELS", "coalesce_runs", "copy_rows", "native_kernel"]

#: Default staging buffer size (used only by the "staged" fallback kernel).
DEFAULT_STAGING_BYTES = 2 << 20

#: Kernel names `copy_rows` accepts.
KERNELS = ("auto", "native", "numpy", "runs", "staged")

# The staged kernel moves at most this much per chunk so the staging rows stay in L2.
_STAGE_CHUNK_BYTES = 512 << 10

# Without the native kernel: runs shorter than this on average go through the staged kernel.
_RUN_MIN_BYTES = 192 << 10

_C_SOURCE = b"""
#include <stdint.h>
#include <string.h>
/* Copy row s[i] of src to row d[i] of dst, merging pairs adjacent on both sides into one memmove.
   Returns the number of runs, or -1 (nothing copied) when an id is out of range. */
int64_t tierkv_copy_rows(char *dst, const char *src, const int64_t *d, const int64_t *s,
                         int64_t n, int64_t row, int64_t dst_rows, int64_t src_rows) {
    for (int64_t i = 0; i < n; i++)
        if (s[i] < 0 || s[i] >= src_rows || d[i] < 0 || d[i] >= dst_rows) return -1;
    int64_t runs = 0;
    for (int64_t i = 0, j; i < n; i = j, runs++) {
        for (j = i + 1; j < n && s[j] == s[j - 1] + 1 && d[j] == d[j - 1] + 1; j++) {}
        memmove(dst + d[i] * row, src + s[i] * row, (size_t)((j - i) * row));
    }
    return runs;
}
"""


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


def _runs_in_order(src_ids: SlotIds, dst_ids: SlotIds) -> tuple[SlotIds, SlotIds, SlotIds]:
    """Like `coalesce_runs` in the caller's order (as the native kernel does; sorting by source
    measured a few % slower on scattered pages, and ascending batches coalesce all the same)."""
    n = src_ids.size
    brk = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate((np.zeros(min(n, 1), dtype=np.int64), brk))
    lengths = np.diff(np.append(starts, n))
    return src_ids[starts], dst_ids[starts], lengths


@functools.cache
def native_kernel() -> Any | None:
    """The compiled C copy loop (a ctypes function), or None where it cannot be built.

    Built once per source version and machine with ``$CC`` (default ``cc``) into
    ``$TIERKV_CACHE_DIR`` (default ``~/.cache/tierkv``); ``TIERKV_NATIVE_KERNEL=0`` disables it.
    Never raises: any failure (no compiler, read-only cache) means the numpy kernels are used.
    """
    if os.environ.get("TIERKV_NATIVE_KERNEL", "1") == "0" or sys.platform == "win32":
        return None
    try:
        fn = build_library("copy_rows", _C_SOURCE).tierkv_copy_rows
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    fn.restype = ctypes.c_int64
    return fn


def copy_rows(
    src: npt.NDArray[np.uint8],
    src_ids: SlotIds,
    dst: npt.NDArray[np.uint8],
    dst_ids: SlotIds,
    staging: npt.NDArray[np.uint8],
    *,
    kernel: str = "auto",
) -> tuple[int, str]:
    """Copy rows `src[src_ids]` into `dst[dst_ids]` (2-D C-contiguous uint8, equal row size).

    `kernel` is one of KERNELS: "auto" is "native" when it is available, else "numpy", which
    picks "runs" for long runs and "staged" otherwise. `dst_ids` must be unique (callers check).
    Raises IndexError for an id out of range (before copying anything) and ValueError for an
    unknown or unavailable kernel. Returns (number of runs, kernel used).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    row = src.shape[1]
    if dst.shape[1] != row or src_ids.size != dst_ids.size:
        raise ValueError(f"rows of {row} B and {dst.shape[1]} B, or id counts differ")
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    dst_ids = np.ascontiguousarray(dst_ids, dtype=np.int64)
    if kernel == "auto":
        kernel = "native" if native_kernel() is not None else "numpy"
    if kernel == "native":
        # The whole batch is one C call; it checks ids and finds runs itself (per-batch Python
        # work runs with caches just flushed by the previous copy, so keep it minimal).
        fn = native_kernel()
        if fn is None:
            raise ValueError("the native copy kernel is not available (no C compiler?)")
        if not (src.flags.c_contiguous and dst.flags.c_contiguous):
            raise ValueError("the native copy kernel needs C-contiguous arrays")
        nruns = fn(dst.ctypes.data, src.ctypes.data, dst_ids.ctypes.data, src_ids.ctypes.data,
                   src_ids.size, row, dst.shape[0], src.shape[0])  # fmt: skip
        if nruns < 0:
            raise IndexError(f"slot id out of range ({src.shape[0]} / {dst.shape[0]} rows)")
        return nruns, "native" if nruns else "none"
    if src_ids.size and (
        min(src_ids.min(), dst_ids.min()) < 0
        or src_ids.max() >= src.shape[0]
        or dst_ids.max() >= dst.shape[0]
    ):
        raise IndexError(f"slot id out of range ({src.shape[0]} / {dst.shape[0]} rows)")
    s0, d0, lengths = _runs_in_order(src_ids, dst_ids)
    nruns = int(lengths.size)
    if nruns == 0:
        return 0, "none"
    chunk = min(staging.size, max(row, _STAGE_CHUNK_BYTES)) // row
    if kernel == "numpy":
        long_runs = nruns == 1 or src_ids.size * row >= _RUN_MIN_BYTES * nruns
        kernel = "runs" if long_runs or chunk == 0 else "staged"
    if kernel == "runs":
        for s, d, n in zip(s0.tolist(), d0.tolist(), lengths.tolist()):
            np.copyto(dst[d : d + n], src[s : s + n])
        return nruns, "runs"
    if chunk == 0:
        raise ValueError(f"staging buffer ({staging.size} B) is smaller than one row ({row} B)")
    # One void item per row: take and fancy assignment then move whole rows per index.
    rows = np.dtype((np.void, row))
    src_v, dst_v = src.view(rows)[:, 0], dst.view(rows)[:, 0]  # views, even when row-strided
    stage = staging[: chunk * row].view(rows)
    for i in range(0, src_ids.size, chunk):
        s = src_ids[i : i + chunk]
        out = stage[: s.size]
        # mode="clip": ids are already checked; "raise" would buffer `out` in a temporary.
        np.take(src_v, s, out=out, mode="clip")
        dst_v[dst_ids[i : i + chunk]] = out
    return nruns, "staged"
