from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.runtime import ArenaFullError
from tierkv.runtime.errors import DoubleFreeError, InvalidSlotError
from tierkv.runtime.freelist import SlotFreeList, as_slot_ids


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
