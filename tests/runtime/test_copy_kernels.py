from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.runtime import CpuBackend
from tierkv.runtime.copy_kernels import copy_rows, native_kernel

HAVE_NATIVE = native_kernel() is not None
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


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_native_kernel_builds_into_its_cache_dir(
    fresh_native_cache: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TIERKV_NATIVE_KERNEL", raising=False)
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    assert native_kernel() is not None
    assert len(list(tmp_path.glob("copy_rows-*.so"))) == 1
    native_kernel.cache_clear()
    assert native_kernel() is not None  # loads the cached build


def test_broken_compiler_falls_back(
    fresh_native_cache: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native_kernel() is None
    assert not list(tmp_path.glob("*.so"))
