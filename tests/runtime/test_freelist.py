from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.runtime import ArenaFullError
from tierkv.runtime.errors import DoubleFreeError, InvalidSlotError
from tierkv.runtime.freelist import SlotFreeList, as_slot_ids, native_id_check


def test_fresh_list_hands_out_ascending_runs() -> None:
    fl = SlotFreeList(8)
    assert fl.allocate(3).tolist() == [0, 1, 2]
    assert fl.allocate(2).tolist() == [3, 4]
    assert fl.num_free == 3


def test_full_raises_and_changes_nothing() -> None:
    fl = SlotFreeList(4)
    fl.allocate(3)
    with pytest.raises(ArenaFullError) as info:
        fl.allocate(2)
    assert info.value.free == 1 and info.value.requested == 2
    assert fl.num_free == 1


def test_double_free_raises_and_changes_nothing() -> None:
    fl = SlotFreeList(6)
    ids = fl.allocate(4)
    fl.free(ids[:2])
    before = (fl.num_free, fl.allocated_mask().copy())
    with pytest.raises(DoubleFreeError):
        fl.free(ids[1:3])  # slot ids[1] is already free, ids[2] is not
    assert (fl.num_free, fl.allocated_mask().tolist()) == (before[0], before[1].tolist())


@pytest.mark.parametrize(
    "bad",
    [[-1], [8], [1, 1], [[1, 2]], np.array([0.5]), "x"],
)
def test_bad_ids_raise_typed_error(bad: object) -> None:
    with pytest.raises(InvalidSlotError):
        as_slot_ids(bad, 8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_free_list_invariants(ops: list[tuple[bool, int]]) -> None:
    n = 16
    fl = SlotFreeList(n)
    held: list[int] = []
    for is_alloc, k in ops:
        if is_alloc:
            if k > fl.num_free:
                with pytest.raises(ArenaFullError):
                    fl.allocate(k)
                continue
            got = fl.allocate(k).tolist()
            assert not set(got) & set(held)
            held += got
        else:
            k = min(k, len(held))
            fl.free(np.array(held[:k], dtype=np.int64))
            held = held[k:]
        assert fl.num_free + len(held) == n
        assert sorted(np.flatnonzero(fl.allocated_mask()).tolist()) == sorted(held)


HAVE_NATIVE_CHECK = native_id_check() is not None


@pytest.fixture
def numpy_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """as_slot_ids with the native check disabled (the numpy path); restored afterwards."""
    native_id_check.cache_clear()
    monkeypatch.setenv("TIERKV_NATIVE_KERNEL", "0")
    assert native_id_check() is None
    yield
    monkeypatch.undo()
    native_id_check.cache_clear()


def _verdict(ids: object, n: int) -> str:
    try:
        return str(as_slot_ids(ids, n).tolist())
    except InvalidSlotError as exc:
        return str(exc)


# ids that collide in a multiplicative hash (equal low bits), and batches past the C stack table
_COLLIDING = sorted({(1 << k) * j for k in (10, 20, 40) for j in range(40)})


@pytest.mark.skipif(not HAVE_NATIVE_CHECK, reason="tierkv.runtime._copy not built here")
@pytest.mark.parametrize(
    ("ids", "limit"),
    [
        ([], 8),
        ([3], 8),
        ([3, 3], 8),
        ([0, 7, 8], 8),
        ([-1, 2], 8),
        (list(range(600)), 600),
        ([*range(2000), 1999], 4000),
        ([*range(2000), 2000], 2000),
        (_COLLIDING, 1 << 47),
        ([*_COLLIDING, 39 << 40], 1 << 47),
        (np.arange(5000, dtype=np.uint32)[::-2], 5000),  # strided, another dtype
    ],
)
def test_native_id_check_agrees_with_numpy(
    ids: list[int], limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = _verdict(ids, limit)
    native_id_check.cache_clear()
    monkeypatch.setenv("TIERKV_NATIVE_KERNEL", "0")
    try:
        assert native_id_check() is None
        assert _verdict(ids, limit) == native
    finally:
        monkeypatch.undo()
        native_id_check.cache_clear()


@pytest.mark.skipif(not HAVE_NATIVE_CHECK, reason="tierkv.runtime._copy not built here")
@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-3, 3000), max_size=1200), st.integers(1, 3000))
def test_native_id_check_finds_every_bad_id(ids: list[int], limit: int) -> None:
    check = native_id_check()
    assert check is not None
    arr = np.array(ids, dtype=np.int64)
    want = 1 if any(not 0 <= i < limit for i in ids) else 2 if len(set(ids)) < len(ids) else 0
    assert check(arr, limit) == want


def test_numpy_path_without_the_extension(numpy_check: None) -> None:
    assert as_slot_ids([4, 1], 8).tolist() == [4, 1]
    with pytest.raises(InvalidSlotError, match="duplicated"):
        as_slot_ids([1, 4, 1], 8)
    with pytest.raises(InvalidSlotError, match=r"got \[1, 8\]"):
        as_slot_ids([1, 8], 8)


@pytest.mark.skipif(not HAVE_NATIVE_CHECK, reason="tierkv.runtime._copy not built here")
def test_native_id_check_rejects_a_malformed_buffer() -> None:
    check = native_id_check()
    assert check is not None
    with pytest.raises(ValueError, match="int64"):
        check(np.zeros(3, dtype=np.uint8), 8)  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-3, 70), max_size=80), st.integers(1, 70))
def test_a_short_list_of_ints_is_checked_as_an_array_is(ids: list[int], limit: int) -> None:
    # up to 64 Python ints go through array("q") and the native check, not numpy's
    # conversion: the same ids, or the same typed error, as the int64 array of them
    assert _verdict(ids, limit) == _verdict(np.array(ids, dtype=np.int64), limit)
    if len(ids) <= 64 and _verdict(ids, limit).startswith("["):
        got = as_slot_ids(ids, limit)
        assert got.dtype == np.int64 and got.flags.writeable


def test_a_short_list_that_is_not_of_ints_keeps_the_numpy_checks() -> None:
    for bad in ([1.5], [True], [2**70], [1, "x"]):
        with pytest.raises(InvalidSlotError):
            as_slot_ids(bad, 8)
    ids = [3, 1]
    out = as_slot_ids(ids, 8)
    out[0] = 7  # the caller's list is never the result's buffer
    assert ids == [3, 1]
