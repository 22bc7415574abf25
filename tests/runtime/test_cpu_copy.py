from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.runtime import CpuBackend
from tierkv.runtime.cpu_copy import copy_rows, native_kernel, native_streaming

HAVE_NATIVE = native_kernel() is not None
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="tierkv.runtime._copy not built here")
KERNELS = ["auto", "numpy", "runs", "staged"] + (["native"] if HAVE_NATIVE else [])

PAIRS = {
    "empty": ([], []),
    "single": ([7], [0]),
    "one run": ([3, 4, 5, 6], [10, 11, 12, 13]),
    "reversed": ([5, 4, 3, 2], [1, 2, 3, 4]),
    "scattered": ([9, 1, 30, 17, 22], [0, 8, 3, 31, 12]),
    "mixed runs": ([0, 1, 2, 9, 20, 21], [30, 31, 32, 5, 6, 7]),
}
RUNS = {"empty": 0, "single": 1, "one run": 1, "reversed": 4, "scattered": 5, "mixed runs": 3}


@pytest.fixture
def fresh_native_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let a test rebuild or disable the native kernel; restore the shared one afterwards."""
    native_kernel.cache_clear()
    yield
    monkeypatch.undo()
    native_kernel.cache_clear()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pattern", list(PAIRS))
def test_every_kernel_copies_exactly_the_given_rows(pattern: str, kernel: str) -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (40, 96), np.uint8)
    dst = rng.integers(0, 256, (40, 96), np.uint8)
    s, d = (np.array(x, dtype=np.int64) for x in PAIRS[pattern])
    want = dst.copy()
    want[d] = src[s]
    staging = np.zeros(2 * 96, np.uint8)  # two rows: several chunks through "staged"
    runs, used = copy_rows(src, s, dst, d, staging, kernel=kernel)
    assert np.array_equal(dst, want)
    assert runs == RUNS[pattern]
    if runs:
        assert used == (kernel if kernel in ("native", "runs", "staged") else used)
        assert used != "native" or HAVE_NATIVE


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [([0, 40], [1, 2]), ([0, 1], [2, -1]), ([-1], [3])])
def test_out_of_range_ids_raise_and_copy_nothing(kernel: str, bad: tuple[list[int], ...]) -> None:
    src = np.ones((40, 64), np.uint8)
    dst = np.zeros((40, 64), np.uint8)
    s, d = (np.array(x, dtype=np.int64) for x in bad)
    with pytest.raises(IndexError):
        copy_rows(src, s, dst, d, np.zeros(1024, np.uint8), kernel=kernel)
    assert not dst.any()


def test_unknown_kernel_is_rejected() -> None:
    with pytest.raises(ValueError):
        CpuBackend(kernel="bogus")
    with pytest.raises(ValueError):
        copy_rows(
            np.zeros((4, 8), np.uint8),
            np.array([0]),
            np.zeros((4, 8), np.uint8),
            np.array([1]),
            np.zeros(64, np.uint8),
            kernel="bogus",
        )


def test_native_kernel_can_be_disabled(
    fresh_native_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERKV_NATIVE_KERNEL", "0")
    assert native_kernel() is None
    src = np.arange(4 * 8, dtype=np.uint8).reshape(4, 8)
    dst = np.zeros_like(src)
    _, used = copy_rows(src, np.array([2]), dst, np.array([0]), np.zeros(64, np.uint8))
    assert used == "runs" and np.array_equal(dst[0], src[2])
    with pytest.raises(ValueError):
        CpuBackend(kernel="native")


def test_native_kernel_is_the_extension_built_at_install() -> None:
    if not HAVE_NATIVE:
        pytest.skip("tierkv.runtime._copy was not built here")
    from tierkv.runtime import _copy

    assert native_kernel() is _copy.copy_rows
    assert native_streaming() == _copy.STREAMING
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert native_streaming() in ("avx2", "sse2")


def test_without_the_extension_numpy_kernels_are_used(
    fresh_native_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tierkv.runtime._copy", None)  # as if never built
    assert native_kernel() is None and native_streaming() == ""
    src = np.arange(6 * 8, dtype=np.uint8).reshape(6, 8)
    dst = np.zeros_like(src)
    runs, used = copy_rows(src, np.array([4, 1]), dst, np.array([0, 5]), np.zeros(64, np.uint8))
    assert used in ("runs", "staged") and runs == 2
    assert np.array_equal(dst[[0, 5]], src[[4, 1]])
    with pytest.raises(ValueError, match="not built"):
        CpuBackend(kernel="native")
    with pytest.raises(ValueError, match="not built"):
        copy_rows(src, np.array([0]), dst, np.array([1]), np.zeros(64, np.uint8), kernel="native")


def _rows(
    nrows: int, row: int, skew: int, fill: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A C-contiguous (nrows, row) array starting `skew` bytes into a buffer with 64 guard
    bytes on each side; returns (array, whole buffer)."""
    rng = np.random.default_rng(nrows * 7919 + row)
    buf = rng.integers(0, 256, skew + nrows * row + 128, np.uint8)
    if fill is not None:
        buf[:] = fill
    return buf[64 + skew : 64 + skew + nrows * row].reshape(nrows, row), buf


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    row=st.sampled_from([1, 7, 63, 64, 65, 127, 1000, 1023, 1024, 1025, 4097, 16384])
    | st.integers(1, 5000),
    shape=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    skews=st.tuples(st.integers(0, 63), st.integers(0, 63)),
    data=st.data(),
    stream_min=st.sampled_from([0, 1 << 62, 4096]),
    in_order=st.booleans(),
)
def test_native_gives_the_bytes_of_the_numpy_kernels(
    row: int,
    shape: tuple[int, int],
    skews: tuple[int, int],
    data: st.DataObject,
    stream_min: int,
    in_order: bool,
) -> None:
    """Odd row sizes, unaligned starts, runs of every length, both store paths (streamed and
    memcpy): the native kernel writes exactly the bytes numpy does, and nothing outside."""
    nsrc, ndst = shape
    n = data.draw(st.integers(0, min(nsrc, ndst)), label="pairs")
    ids = st.lists(st.integers(0, nsrc - 1), min_size=n, max_size=n, unique=True)
    s = data.draw(ids, label="src ids")
    d = data.draw(st.lists(st.integers(0, ndst - 1), min_size=n, max_size=n, unique=True))
    if in_order:  # long runs: both sides ascending
        s, d = sorted(s), sorted(d)
    src_ids, dst_ids = np.array(s, np.int64), np.array(d, np.int64)
    src, _ = _rows(nsrc, row, skews[0])
    results = []
    for kernel in ("native", "runs", "staged"):
        dst, whole = _rows(ndst, row, skews[1], fill=0xA5)
        staging = np.zeros(3 * row, np.uint8)
        runs, _ = copy_rows(
            src, src_ids, dst, dst_ids, staging, kernel=kernel, stream_min_bytes=stream_min
        )
        results.append((runs, whole.copy()))
    want = _rows(ndst, row, skews[1], fill=0xA5)[1]
    want[64 + skews[1] : 64 + skews[1] + ndst * row].reshape(ndst, row)[dst_ids] = src[src_ids]
    for runs, whole in results:
        assert runs == results[0][0]
        assert np.array_equal(whole, want)  # guard bytes included


@needs_native
@pytest.mark.parametrize("stream_min", [0, 1 << 62])
@pytest.mark.parametrize("shift", [1, -1, 3])
def test_a_run_overlapping_itself_copies_as_memmove(stream_min: int, shift: int) -> None:
    arr, _ = _rows(64, 1100, 5)
    want = arr.copy()
    s = np.arange(10, 40, dtype=np.int64)
    want[s + shift] = arr[s].copy()
    runs, _ = copy_rows(arr, s, arr, s + shift, np.zeros(0, np.uint8), stream_min_bytes=stream_min)
    assert runs == 1 and np.array_equal(arr, want)


@needs_native
def test_the_native_kernel_rejects_malformed_arguments() -> None:
    fn = native_kernel()
    assert fn is not None
    ids = np.zeros(1, np.int64)
    dst = np.zeros((4, 8), np.uint8)
    with pytest.raises(ValueError):
        fn(dst, dst, ids, ids, 0, 0)  # row size 0
    with pytest.raises(ValueError):
        fn(dst, np.zeros(12, np.uint8), ids, ids, 8, 0)  # not whole rows
    with pytest.raises(ValueError):
        fn(dst, dst, ids, np.zeros(2, np.int64), 8, 0)  # id counts differ
    with pytest.raises(ValueError):
        fn(dst, dst, np.zeros(3, np.uint8), np.zeros(3, np.uint8), 8, 0)  # not int64
    with pytest.raises(BufferError):
        fn(bytes(32), dst, ids, ids, 8, 0)  # read-only destination
    ro = np.zeros((4, 8), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_rows(dst, ids, ro, ids, np.zeros(64, np.uint8), kernel="native")


_SSE2_CHECK = """
import numpy as np
from tierkv.runtime.cpu_copy import copy_rows, native_streaming
assert native_streaming() == "sse2", native_streaming()
rng = np.random.default_rng(1)
for row in (1000, 1024, 4097, 16384):
    for stream_min in (0, 1 << 62):
        src = rng.integers(0, 256, (64, row), np.uint8)
        buf = rng.integers(0, 256, 64 * row + 70, np.uint8)
        dst = buf[3 : 3 + 64 * row].reshape(64, row)
        s = rng.permutation(64)[:40]
        d = np.concatenate([np.arange(5, 25), rng.permutation(np.arange(30, 64))[:20]])
        want = buf.copy()
        want[3 : 3 + 64 * row].reshape(64, row)[d] = src[s]
        copy_rows(src, s, dst, d, np.zeros(0, np.uint8), stream_min_bytes=stream_min)
        assert np.array_equal(buf, want), (row, stream_min)
print("ok")
"""


@needs_native
@pytest.mark.skipif(native_streaming() != "avx2", reason="the AVX2 path is not in use here")
def test_the_sse2_path_gives_the_same_bytes() -> None:
    """Where the CPU has AVX2 the SSE2 path is otherwise never run: force it in a child."""
    out = subprocess.run(
        [sys.executable, "-c", _SSE2_CHECK],
        env={**os.environ, "TIERKV_COPY_AVX2": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
