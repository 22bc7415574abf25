"""The cuda backend's pure arithmetic and its gate: all of it runs without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tierkv.runtime as runtime
from tierkv.runtime import BackendUnavailableError, create_backend
from tierkv.runtime.cpu_copy import coalesce_runs
from tierkv.runtime.cuda_backend import CUDA_BACKEND_READY, DEFAULT_WAIT_STRATEGY, CudaBackend
from tierkv.runtime.cuda_env import cuda_available, unavailable_reason
from tierkv.runtime.cuda_kernels import (
    KERNEL_NAMES,
    KERNEL_SOURCE,
    MAX_GRID_X,
    THREADS,
    UNROLL,
    choose_method,
    launch_plans,
    split_runs,
    vector_width,
)
from tierkv.runtime.cuda_stream import WAIT_STRATEGIES, check_strategy, pick_wait_strategy

ids = np.asarray

# -- the gate ----------------------------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="CUDA is present")
def test_without_cuda_the_backend_explains_and_auto_picks_cpu() -> None:
    reason = unavailable_reason()
    assert reason and ("CuPy" in reason or "CUDA" in reason)
    with pytest.raises(BackendUnavailableError, match=r"CuPy|CUDA"):
        create_backend("cuda")
    with pytest.raises(BackendUnavailableError, match=r"CuPy|CUDA"):
        CudaBackend()
    assert create_backend("auto").name == "cpu"
    assert "cuda" not in runtime.available_backends()


def test_the_backend_is_declared_ready_and_options_are_checked_first() -> None:
    assert CUDA_BACKEND_READY
    assert DEFAULT_WAIT_STRATEGY in WAIT_STRATEGIES
    with pytest.raises(ValueError, match="wait strategy"):
        CudaBackend(wait_strategy="spin")
    with pytest.raises(ValueError, match="copy method"):
        CudaBackend(copy_method="dma")


def test_importing_the_cuda_modules_does_not_import_cupy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, runtime, runtime.cuda_backend, runtime.cuda_ipc, runtime.cuda_stream;"
        "print('cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- wait strategy selection -------------------------------------------------------------------


def test_strategy_names_are_checked() -> None:
    assert check_strategy("poll") == "poll"
    with pytest.raises(ValueError):
        check_strategy("busy")


def test_pick_wait_strategy_prefers_low_latency_without_stalls() -> None:
    fast_but_stalls = {"latency_s": 5e-6, "stall_s": 3e-3}
    slower = {"latency_s": 40e-6, "stall_s": 2e-4}
    assert pick_wait_strategy({"poll": fast_but_stalls, "thread": slower}) == "thread"
    assert pick_wait_strategy({"poll": slower, "thread": {"latency_s": 90e-6, "stall_s": 0}}) == (
        "poll"
    )
    tie = {"latency_s": 1e-5, "stall_s": 0.0}
    assert pick_wait_strategy({"poll": tie, "thread": dict(tie)}) == "thread"
    # when every strategy stalls, the fastest still wins
    assert pick_wait_strategy({"poll": fast_but_stalls, "thread": {**slower, "stall_s": 2e-3}})
    with pytest.raises(ValueError):
        pick_wait_strategy({})


# -- kernel source and launch arithmetic ---------------------------------------------------------


def test_kernel_source_defines_every_kernel_once() -> None:
    for name in KERNEL_NAMES.values():
        assert KERNEL_SOURCE.count(f"TIERKV_COPY_KERNEL({name},") == 1
    assert 'extern "C" __global__' in KERNEL_SOURCE
    assert KERNEL_SOURCE.count("{") == KERNEL_SOURCE.count("}")
    assert KERNEL_SOURCE.count("(") == KERNEL_SOURCE.count(")")


@pytest.mark.parametrize(
    "slot,addrs,vec",
    [(16384, (0, 256), 16), (16384, (0, 8), 8), (24, (0, 0), 8), (12, (0, 4), 4), (7, (0, 0), 1)],
)
def test_vector_width(slot: int, addrs: tuple[int, int], vec: int) -> None:
    assert vector_width(slot, *addrs) == vec


@pytest.mark.parametrize("slot", [16 << 10, 256 << 10, 1 << 20, 48, 16])
def test_launch_plan_covers_every_byte_once(slot: int) -> None:
    (plan,) = launch_plans(10, slot, 16)
    assert plan.block == (THREADS, 1, 1)
    assert plan.units_per_slot * plan.vec == slot
    assert plan.units_per_chunk == THREADS * UNROLL
    assert plan.grid[0] == 10 * plan.chunks_per_page
    # chunk c of a page covers [c*upc, min((c+1)*upc, ups)): together exactly [0, ups)
    covered = sum(
        min((c + 1) * plan.units_per_chunk, plan.units_per_slot) - c * plan.units_per_chunk
        for c in range(plan.chunks_per_page)
    )
    assert covered == plan.units_per_slot
    assert (plan.chunks_per_page - 1) * plan.units_per_chunk < plan.units_per_slot


def test_page_sizes_of_the_issue() -> None:
    # 16 KB: one block per page; 1 MB: 32 blocks of 32 KB
    assert launch_plans(1, 16 << 10, 16)[0].chunks_per_page == 1
    assert launch_plans(1, 1 << 20, 16)[0].chunks_per_page == (1 << 20) // (THREADS * UNROLL * 16)


def test_huge_batches_split_into_launches_within_the_grid_limit() -> None:
    plans = launch_plans(1000, 1 << 20, 16, max_grid_x=100)
    assert all(p.grid[0] <= 100 for p in plans)
    assert [p.first for p in plans] == list(range(0, 1000, 3))
    assert sum(p.count for p in plans) == 1000
    assert launch_plans(5, 64, 16)[0].grid[0] <= MAX_GRID_X
    assert launch_plans(0, 64, 16) == []


@pytest.mark.parametrize("args", [(1, 10, 16), (1, 0, 16), (1, 64, 3), (-1, 64, 16)])
def test_bad_launch_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        launch_plans(*args)


# -- run splitting at pinned-chunk boundaries ----------------------------------------------------


def test_split_runs_example() -> None:
    s, d, n = split_runs(ids([6]), ids([0]), ids([4]), 8, None)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([6, 8], [0, 2], [2, 2])
    s, d, n = split_runs(ids([0]), ids([3]), ids([6]), None, 4)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 1, 5], [3, 4, 8], [1, 4, 1])


@given(
    st.lists(st.integers(0, 63), min_size=1, max_size=40, unique=True),
    st.integers(1, 9),
    st.one_of(st.none(), st.integers(1, 9)),
    st.randoms(use_true_random=False),
)
def test_split_runs_covers_the_same_pairs_and_never_crosses(
    src: list[int], cs: int, cd: int | None, rnd: object
) -> None:
    dst = list(range(64))
    rnd.shuffle(dst)  # type: ignore[attr-defined]
    s_ids, d_ids = np.array(src, np.int64), np.array(dst[: len(src)], np.int64)
    s0, d0, n = split_runs(*coalesce_runs(s_ids, d_ids), cs, cd)
    pairs = {(s + k, d + k) for s, d, m in zip(s0, d0, n) for k in range(m)}
    assert pairs == set(zip(s_ids.tolist(), d_ids.tolist()))
    assert n.sum() == len(src) and (n > 0).all()
    assert all((s // cs) == ((s + m - 1) // cs) for s, m in zip(s0, n))
    if cd:
        assert all((d // cd) == ((d + m - 1) // cd) for d, m in zip(d0, n))


# -- method choice -----------------------------------------------------------------------------

ADJ = ids(np.arange(64))
SCATTERED = ids(np.arange(64) * 2)


@pytest.mark.parametrize(
    "src,dst,s_ids,d_ids,slot,kw,want",
    [
        ("pinned", "pinned", ADJ, ADJ, 4096, {}, "host"),
        ("pageable", "pinned", ADJ, ADJ, 4096, {}, "host"),
        ("pageable", "device", SCATTERED, ADJ, 4096, {}, "memcpy"),  # a kernel cannot read it
        ("pinned", "device", SCATTERED, ADJ, 16 << 10, {}, "kernel"),  # scattered small pages
        ("device", "pinned", ADJ, ADJ, 16 << 10, {}, "memcpy"),  # one 1 MB run
        ("device", "device", SCATTERED, SCATTERED, 1 << 20, {}, "memcpy"),  # 1 MB runs
        ("device", "device", SCATTERED, SCATTERED, 256 << 10, {}, "kernel"),
        ("pinned", "device", SCATTERED, ADJ, 16 << 10, {"kernel_ok": False}, "memcpy"),
        ("device", "device", SCATTERED, ADJ, 16 << 10, {"kernel_ok": False}, "kernel"),
        ("device", "pinned", ADJ, ADJ, 16 << 10, {"method": "kernel"}, "kernel"),
        ("pinned", "device", SCATTERED, ADJ, 16 << 10, {"method": "memcpy"}, "memcpy"),
    ],
)
def test_choose_method(
    src: str, dst: str, s_ids: np.ndarray, d_ids: np.ndarray, slot: int, kw: dict, want: str
) -> None:
    assert choose_method(src, dst, s_ids, d_ids, slot, **kw) == want


def test_choose_method_rejects_unknown_names() -> None:
    with pytest.raises(ValueError):
        choose_method("gpu", "device", ADJ, ADJ, 64)
    with pytest.raises(ValueError):
        choose_method("device", "device", ADJ, ADJ, 64, method="dma")


def test_kernel_source_compiles_with_nvrtc_to_vector_loads() -> None:
    """Compiles to PTX without a GPU when CuPy and NVRTC are installed (skips otherwise)."""
    pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(KERNEL_SOURCE, "tierkv_copy.cu", [], [])
    except Exception as exc:  # no libnvrtc here
        pytest.skip(f"NVRTC not available: {exc!r}")
    nvrtc.compileProgram(prog, ["--gpu-architecture=compute_80", "-std=c++17"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for name in KERNEL_NAMES.values():
        assert f".entry {name}(" in ptx
    assert "ld.global.v4.u32" in ptx and "st.global.v4.u32" in ptx  # 16-byte accesses
