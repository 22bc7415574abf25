"""Budgets are limits (issue 13, finding 5): arenas reserve address space and commit memory
only as slots are first written, so a budget above physical memory maps at once."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from tierkv.runtime import ArenaError, CpuBackend
from tierkv.runtime.arena import MAP_NORESERVE, allocate_host_buffer

GIB = 1 << 30
MIB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def overcommit_mode() -> str:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return "unknown"


needs_lazy_commit = pytest.mark.skipif(
    not Path("/proc/self/status").exists() or overcommit_mode() == "2" or MAP_NORESERVE == 0,
    reason="needs Linux without strict overcommit (vm.overcommit_memory=2 commits up front)",
)


@needs_lazy_commit
def test_a_64_gib_arena_maps_at_once_and_commits_only_what_is_written(
    backend: CpuBackend,
) -> None:
    before = rss_bytes()
    a = backend.create_arena("host", slot_bytes=MIB, num_slots=64 * 1024)  # 64 GiB of budget
    assert a.nbytes == 64 * GIB
    assert rss_bytes() - before < 32 * MIB  # the slot free list, not the buffer
    a.allocate(a.num_slots)
    first, last = a.slot_view(0), a.slot_view(a.num_slots - 1)
    first.fill_(7)
    last.fill_(9)
    assert int(first[MIB - 1]) == 7 and int(last[0]) == 9
    assert int(a.array[1, 0]) == 0 and int(a.array[a.num_slots - 2, -1]) == 0  # zero-filled
    assert rss_bytes() - before < 64 * MIB  # two slots (at most two huge pages each) committed


@needs_lazy_commit
def test_host_buffer_is_not_touched_up_front() -> None:
    before = rss_bytes()
    buf = allocate_host_buffer(16 * GIB)
    assert buf.size == 16 * GIB
    assert rss_bytes() - before < 16 * MIB
    buf[: 4 * MIB] = 1
    assert int(buf[: 4 * MIB].sum()) == 4 * MIB
    assert rss_bytes() - before < 32 * MIB


def test_a_budget_beyond_the_address_space_is_an_arena_error(backend: CpuBackend) -> None:
    with pytest.raises(ArenaError, match="cannot map"):
        backend.create_arena("host", slot_bytes=GIB, num_slots=1 << 30)  # 2**60 bytes


def test_noreserve_flag_matches_the_platform() -> None:
    flag = getattr(mmap, "MAP_NORESERVE", None)
    if flag is not None:
        assert flag == MAP_NORESERVE
    else:
        assert MAP_NORESERVE in (0, 0x40, 0x400, 0x4000, 0x10000)


@needs_lazy_commit
def test_the_cuda_backends_host_arena_maps_lazily_too() -> None:
    from tierkv.runtime.cuda_arena import HostArena  # host memory only: no CUDA call until pinned

    before = rss_bytes()
    a = HostArena("host", MIB, 32 * 1024, pinned=False, backend="cpu")  # 32 GiB, never pinned
    assert a.nbytes == 32 * GIB
    assert rss_bytes() - before < 32 * MIB
    a.slot_view(5).fill_(3)
    assert int(a.array[5, 0]) == 3 and rss_bytes() - before < 48 * MIB


@needs_lazy_commit
def test_prefault_commits_slots_without_changing_a_byte(backend: CpuBackend) -> None:
    """Issue 17: the store commits device memory ahead of use from a thread, so an append's
    first write to a huge page does not stall the loop; committing must not touch contents."""
    a = backend.create_arena("device", slot_bytes=64 * 1024, num_slots=1024)  # 64 MiB
    a.slot_view(3).fill_(5)  # a slot in use keeps its bytes
    before = rss_bytes()
    if not a.prefault(0, 512):  # 32 MiB
        pytest.skip("no MADV_POPULATE_WRITE here (Linux >= 5.14)")
    assert rss_bytes() - before >= 24 * MIB  # committed now
    assert int(a.slot_view(3).sum()) == 5 * 64 * 1024 and int(a.array[4:512].sum()) == 0
    assert rss_bytes() - before < 48 * MIB  # the slots asked for, not the arena


def test_prefault_of_an_empty_or_out_of_range_span_does_nothing(backend: CpuBackend) -> None:
    a = backend.create_arena("device", slot_bytes=4096, num_slots=16)
    assert a.prefault(4, 0) is False
    assert a.prefault(16, 8) is False  # past the end
    assert a.prefault(-8, 4) is False  # before the start (clipped to nothing)
