"""Batch copy planning for the cuda backend: a gather/scatter kernel and coalesced runs.

Pure arithmetic, no CuPy: everything here is tested without a GPU. A batch moves in one of two
ways, never one cudaMemcpyAsync per small page:

    memcpy   pairs coalesced into runs of adjacent slots (`cpu_copy.coalesce_runs`), cut at
             pinned-chunk boundaries; one cudaMemcpyAsync per run. For few, long runs: the copy
             engines do the work and no SM is used.
    kernel   one launch for the whole batch. Block b copies chunk c of page p:

             grid.x = pages * chunks_per_page          p = b // chunks_per_page
             block  = THREADS threads                  c = b %  chunks_per_page
             chunk  = THREADS * UNROLL vectors of `vec` bytes (the last chunk of a page is short)

             src[src_ids[p]*slot + c*chunk : ...] -> dst[dst_ids[p]*slot + c*chunk : ...]
             Pinned host memory is read or written in place through its mapped (UVA) address.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierkv.transports.errors import InvalidInputError

from .cpu_copy import coalesce_runs
from .freelist import SlotIds

__all__ = [
    "KERNEL_NAMES",
    "KERNEL_SOURCE",
    "MAX_GRID_X",
    "THREADS",
    "UNROLL",
    "LaunchPlan",
    "choose_method",
    "launch_plans",
    "split_runs",
    "vector_width",
]

#: Threads per block, and vectors each thread copies per chunk.
THREADS = 256
UNROLL = 8
#: CUDA's limit on gridDim.x.
MAX_GRID_X = 2**31 - 1

#: Kernel name per vector width in bytes.
KERNEL_NAMES = {
    16: "tierkv_copy_slots_v16",
    8: "tierkv_copy_slots_v8",
    4: "tierkv_copy_slots_v4",
    1: "tierkv_copy_slots_v1",
}

KERNEL_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void tierkv_copy_pages(
    const T* __restrict__ src, T* __restrict__ dst,
    const long long* __restrict__ src_ids, const long long* __restrict__ dst_ids,
    long long units_per_slot, long long units_per_chunk, long long chunks_per_page)
{
    const long long b = (long long)blockIdx.x;
    const long long page = b / chunks_per_page;
    const long long chunk = b - page * chunks_per_page;
    const long long begin = chunk * units_per_chunk;
    long long end = begin + units_per_chunk;
    if (end > units_per_slot) end = units_per_slot;
    const T* s = src + src_ids[page] * units_per_slot;
    T* d = dst + dst_ids[page] * units_per_slot;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        d[i] = s[i];
    }
}

#define TIERKV_COPY_KERNEL(NAME, T)                                                    \
extern "C" __global__ void NAME(                                                       \
    const T* src, T* dst, const long long* src_ids, const long long* dst_ids,          \
    long long units_per_slot, long long units_per_chunk, long long chunks_per_page)    \
{                                                                                      \
    tierkv_copy_pages<T>(src, dst, src_ids, dst_ids,                                   \
                         units_per_slot, units_per_chunk, chunks_per_page);            \
}

TIERKV_COPY_KERNEL(tierkv_copy_slots_v16, uint4)
TIERKV_COPY_KERNEL(tierkv_copy_slots_v8, uint2)
TIERKV_COPY_KERNEL(tierkv_copy_slots_v4, unsigned int)
TIERKV_COPY_KERNEL(tierkv_copy_slots_v1, unsigned char)
"""


def vector_width(slot_bytes: int, *addresses: int) -> int:
    """The widest vector (16, 8, 4 or 1 bytes) that divides `slot_bytes` and every address."""
    for vec in (16, 8, 4):
        if slot_bytes % vec == 0 and all(a % vec == 0 for a in addresses):
            return vec
    return 1


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """One kernel launch: pages [first, first + count) of the batch."""

    kernel: str
    vec: int
    first: int
    count: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    units_per_slot: int
    units_per_chunk: int
    chunks_per_page: int


def launch_plans(
    num_pages: int,
    slot_bytes: int,
    vec: int,
    *,
    threads: int = THREADS,
    unroll: int = UNROLL,
    max_grid_x: int = MAX_GRID_X,
) -> list[LaunchPlan]:
    """The launches that copy `num_pages` pages of `slot_bytes` with `vec`-byte vectors.

    One launch unless the grid would exceed `max_grid_x`. Raises ValueError for bad sizes.
    """
    if vec not in KERNEL_NAMES:
        raise InvalidInputError(f"vector width must be one of {sorted(KERNEL_NAMES)}, got {vec}")
    if slot_bytes <= 0 or slot_bytes % vec:
        raise InvalidInputError(f"slot_bytes {slot_bytes} is not a positive multiple of {vec}")
    if num_pages < 0 or threads <= 0 or unroll <= 0:
        raise InvalidInputError("num_pages must be >= 0, threads and unroll > 0")
    units_per_slot = slot_bytes // vec
    units_per_chunk = threads * unroll
    chunks = -(-units_per_slot // units_per_chunk)
    per_launch = max(1, max_grid_x // chunks)
    plans = []
    for first in range(0, num_pages, per_launch):
        count = min(per_launch, num_pages - first)
        plans.append(
            LaunchPlan(
                kernel=KERNEL_NAMES[vec],
                vec=vec,
                first=first,
                count=count,
                grid=(count * chunks, 1, 1),
                block=(threads, 1, 1),
                units_per_slot=units_per_slot,
                units_per_chunk=units_per_chunk,
                chunks_per_page=chunks,
            )
        )
    return plans


def split_runs(
    src_starts: SlotIds,
    dst_starts: SlotIds,
    lengths: SlotIds,
    src_chunk_slots: int | None = None,
    dst_chunk_slots: int | None = None,
) -> tuple[SlotIds, SlotIds, SlotIds]:
    """Cut runs so that none crosses a chunk boundary on either side.

    A pinned host arena is registered in chunks of `*_chunk_slots` slots; a copy that spans two
    registrations is not a pinned copy. None means "one chunk" (device arenas). Returns new
    (src_starts, dst_starts, lengths) covering exactly the same slots, in the same order::

        src 6 7 | 8 9     (chunk of 8 slots)     ->  run (6, 2) and run (8, 2)
    """
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(src_starts.tolist(), dst_starts.tolist(), lengths.tolist()):
        while n > 0:
            take = n
            if src_chunk_slots:
                take = min(take, src_chunk_slots - s % src_chunk_slots)
            if dst_chunk_slots:
                take = min(take, dst_chunk_slots - d % dst_chunk_slots)
            out_s.append(s)
            out_d.append(d)
            out_n.append(take)
            s, d, n = s + take, d + take, n - take
    as64 = np.int64
    return np.array(out_s, as64), np.array(out_d, as64), np.array(out_n, as64)


def choose_method(
    src_kind: str,
    dst_kind: str,
    src_ids: SlotIds,
    dst_ids: SlotIds,
    slot_bytes: int,
    *,
    method: str = "auto",
    run_min_bytes: int = 1 << 20,
    kernel_ok: bool = True,
) -> str:
    """How to move one batch: "host" (both sides host memory: a numpy copy), "memcpy" (one
    cudaMemcpyAsync per coalesced run) or "kernel" (one gather/scatter launch).

    Kinds are "device", "pinned" or "pageable". A kernel cannot touch pageable memory, and a
    host without mapped registered memory (`kernel_ok=False`) cannot use it for host arenas.
    "auto" picks memcpy when the average run is at least `run_min_bytes` (the copy engines then
    run at full speed without using SMs), the kernel otherwise. Raises ValueError for an unknown
    kind or method.
    """
    for kind in (src_kind, dst_kind):
        if kind not in ("device", "pinned", "pageable"):
            raise InvalidInputError(f"unknown arena kind {kind!r}")
    if method not in ("auto", "kernel", "memcpy"):
        raise InvalidInputError(f"unknown copy method {method!r}")
    if src_kind != "device" and dst_kind != "device":
        return "host"
    touches_host = "pinned" in (src_kind, dst_kind)
    if "pageable" in (src_kind, dst_kind) or (touches_host and not kernel_ok):
        return "memcpy"
    if method != "auto":
        return method
    _, _, lengths = coalesce_runs(src_ids, dst_ids)
    if lengths.size == 0:
        return "memcpy"
    avg_run_bytes = src_ids.size * slot_bytes / lengths.size
    return "memcpy" if avg_run_bytes >= run_min_bytes else "kernel"
