"""Batch copy kernels for host arenas: one call moves a whole batch of slots.

Pairs are cut into runs where both sides are adjacent (in the caller's order)::

    src ids  4 5 6 | 9 | 1 2      dst ids  10 11 12 | 3 | 7 8     ->  3 runs

Kernels (`copy_rows(kernel=...)`):

- ``native``: one C call per batch (`tierkv.runtime._copy`, runtime/_copy.c, built at install
  time by setup.py): it checks every id, finds the runs and copies them with the GIL released,
  the address of each run computed in C from the ids (no per-page Python). A batch of at least
  `STREAM_MIN_BYTES` is written with non-temporal stores: a scattered 16 KB row is too small for
  glibc's memcpy to make that switch, and a store that misses the cache first reads the line it
  overwrites. numpy and torch have no single-pass gather-to-scatter copy (fancy indexing on both
  sides goes through a temporary), and a Python loop of memmoves costs ~1 us a call, a third of a
  16 KB copy. Where the extension was not built (no compiler at install), "auto" falls back to
  the numpy kernels below.
- ``runs``: one numpy copy per run (Python loop per run; fine when runs are long).
- ``staged``: a chunk at a time through a staging buffer kept at most L2-sized: numpy ``take``
  gathers the chunk's source rows, fancy assignment scatters them (C loops, GIL released).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.transports.errors import InvalidInputError

from .freelist import SlotIds

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "KERNELS",
    "STREAM_MIN_BYTES",
    "coalesce_runs",
    "copy_rows",
    "native_kernel",
    "native_streaming",
]

#: Default staging buffer size (used only by the "staged" fallback kernel).
DEFAULT_STAGING_BYTES = 2 << 20

#: Kernel names `copy_rows` accepts.
KERNELS = ("auto", "native", "numpy", "runs", "staged")

#: Batches of at least this many bytes are written with non-temporal stores by the native kernel
#: (about the L2 of one core: a larger batch would evict it anyway; measured faster from 1 MB
#: batches of 16 KB and 256 KB rows on, see docs/runtime.md). Smaller ones stay in cache.
STREAM_MIN_BYTES = 1 << 20

# The staged kernel moves at most this much per chunk so the staging rows stay in L2.
_STAGE_CHUNK_BYTES = 512 << 10

# Without the native kernel: runs shorter than this on average go through the staged kernel.
_RUN_MIN_BYTES = 192 << 10

#: The native kernel's signature: (dst, src, dst_ids, src_ids, row, stream_min) -> runs.
NativeKernel = Callable[[Any, Any, Any, Any, int, int], int]


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


def _native_module() -> ModuleType | None:
    try:  # through sys.modules, so that a test can hide the module
        return importlib.import_module(f"{__package__}._copy")
    except ImportError:  # not built: no compiler at install time, or TIERKV_NO_EXTENSIONS=1
        return None


@functools.cache
def native_kernel() -> NativeKernel | None:
    """The native batch copy (`tierkv.runtime._copy.copy_rows`), or None where the extension
    was not built at install time (no C compiler then) or ``TIERKV_NATIVE_KERNEL=0`` disables it.
    Never raises; without it the numpy kernels are used."""
    if os.environ.get("TIERKV_NATIVE_KERNEL", "1") == "0":
        return None
    module = _native_module()
    return None if module is None else module.copy_rows


def native_streaming() -> str:
    """The instructions of the native kernel's non-temporal path: "avx2", "sse2", or "" where
    there is none (not x86-64, or no native kernel)."""
    module = _native_module() if native_kernel() is not None else None
    return "" if module is None else str(module.STREAMING)


def copy_rows(
    src: npt.NDArray[np.uint8],
    src_ids: SlotIds,
    dst: npt.NDArray[np.uint8],
    dst_ids: SlotIds,
    staging: npt.NDArray[np.uint8],
    *,
    kernel: str = "auto",
    stream_min_bytes: int = STREAM_MIN_BYTES,
) -> tuple[int, str]:
    """Copy rows `src[src_ids]` into `dst[dst_ids]` (2-D C-contiguous uint8, equal row size).

    `kernel` is one of KERNELS: "auto" is "native" when it is available, else "numpy", which
    picks "runs" for long runs and "staged" otherwise. `dst_ids` must be unique (callers check).
    The native kernel writes batches of at least `stream_min_bytes` with non-temporal stores.
    Raises IndexError for an id out of range (before copying anything) and ValueError for an
    unknown or unavailable kernel. Returns (number of runs, kernel used).
    """
    if kernel not in KERNELS:
        raise InvalidInputError(f"unknown kernel {kernel!r}")
    row = src.shape[1]
    if dst.shape[1] != row or src_ids.size != dst_ids.size:
        raise InvalidInputError(f"rows of {row} B and {dst.shape[1]} B, or id counts differ")
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    dst_ids = np.ascontiguousarray(dst_ids, dtype=np.int64)
    if kernel == "auto":
        kernel = "native" if native_kernel() is not None else "numpy"
    if kernel == "native":
        # The whole batch is one C call; it checks ids and finds runs itself (per-batch Python
        # work runs with caches just flushed by the previous copy, so keep it minimal).
        fn = native_kernel()
        if fn is None:
            raise InvalidInputError(
                "the native copy kernel is not available (tierkv.runtime._copy was not built "
                "at install time, or TIERKV_NATIVE_KERNEL=0)"
            )
        if not (src.flags.c_contiguous and dst.flags.c_contiguous):
            raise InvalidInputError("the native copy kernel needs C-contiguous arrays")
        if not dst.flags.writeable:
            raise InvalidInputError("the destination array is read-only")
        # raises IndexError (nothing copied) for an id out of range
        nruns = fn(dst, src, dst_ids, src_ids, row, stream_min_bytes)
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
        raise InvalidInputError(
            f"staging buffer ({staging.size} B) is smaller than one row ({row} B)"
        )
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
