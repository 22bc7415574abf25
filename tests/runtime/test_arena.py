from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.runtime import ArenaError, ArenaFullError, CpuBackend
from tierkv.runtime.errors import DoubleFreeError, InvalidSlotError


def test_arena_layout_and_zero_copy_views(backend: CpuBackend) -> None:
    a = backend.create_arena("host", slot_bytes=64, num_slots=10)
    assert a.tensor.shape == (10, 64) and a.tensor.dtype == torch.uint8
    assert a.nbytes == 640 and a.num_free == 10
    ids = a.allocate(3)
    a.slot_view(int(ids[1])).fill_(7)
    assert a.array[ids[1]].tolist() == [7] * 64  # same memory
    got = a.view(ids)
    assert got.shape == (3, 64) and got[1].eq(7).all()
    got.fill_(1)  # a copy: the arena is untouched
    assert a.array[ids[1], 0] == 7


@pytest.mark.parametrize("slot_bytes,num_slots", [(0, 4), (16, 0), (-1, 4)])
def test_bad_sizes_raise(backend: CpuBackend, slot_bytes: int, num_slots: int) -> None:
    with pytest.raises(ArenaError):
        backend.create_arena("x", slot_bytes=slot_bytes, num_slots=num_slots)


def test_allocate_free_errors_change_nothing(backend: CpuBackend) -> None:
    a = backend.create_arena("host", slot_bytes=16, num_slots=4)
    ids = a.allocate(3)
    with pytest.raises(ArenaFullError):
        a.allocate(2)
    a.free(ids[:1])
    with pytest.raises(DoubleFreeError):
        a.free(ids[:2])
    with pytest.raises(InvalidSlotError):
        a.free([99])
    with pytest.raises(InvalidSlotError):
        a.free(np.array([1.0]))
    with pytest.raises(InvalidSlotError):
        a.slot_view(4)
    assert a.num_free == 2 and a.is_allocated(ids[1:]) and not a.is_allocated(ids[:1])


def test_hand_over_gives_every_slot_to_the_owner() -> None:
    from tierkv.runtime import ArenaError, create_backend

    arena = create_backend("cpu").create_arena("t", slot_bytes=64, num_slots=4)
    arena.hand_over()
    arena.hand_over()  # idempotent
    assert arena.handed_over and arena.is_allocated([0, 1, 2, 3])
    with pytest.raises(ArenaError, match="handed over"):
        arena.allocate(1)
    with pytest.raises(ArenaError, match="handed over"):
        arena.free([0])
    used = create_backend("cpu").create_arena("u", slot_bytes=64, num_slots=4)
    used.allocate(1)
    with pytest.raises(ArenaError, match="already in use"):
        used.hand_over()  # a slot someone holds cannot change hands
    assert not used.handed_over and used.num_free == 3
