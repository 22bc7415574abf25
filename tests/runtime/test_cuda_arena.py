"""Host arenas of the cuda backend: geometry, registration of existing buffers, pin failures.

Pinning is lazy, so everything but the pin itself runs without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.runtime import ArenaError
from tierkv.runtime.cuda_arena import HostArena, PageLockError, pinned_bytes
from tierkv.runtime.cuda_env import cuda_available


def test_host_arena_is_lazy_and_chunked() -> None:
    a = HostArena("host", slot_bytes=1000, num_slots=10, chunk_bytes=3500)
    assert a.kind == "pinned" and a.chunk_slots == 3  # chunks hold whole slots only
    assert a._registered.size == 4 and a.pinned_nbytes == 0
    assert a._chunk_range(3) == (9000, 1000)  # the last chunk is short
    assert a.array.shape == (10, 1000) and a.tensor.shape == (10, 1000)
    ids = a.allocate(4)
    a.array[ids] = 7
    assert a.view(ids).eq(7).all()
    a.close()
    a.close()  # idempotent


def test_pageable_arena_never_pins() -> None:
    a = HostArena("pageable", 64, 8, pinned=False)
    a.ensure_pinned(np.arange(8))
    a.pin_all()
    assert a.kind == "pageable" and a.pinned_nbytes == 0


def test_register_existing_buffers() -> None:
    t = torch.zeros(4, 256, dtype=torch.float32)  # 4 KiB
    a = HostArena.register("t", t, slot_bytes=1024)
    assert a.num_slots == 4 and a.array.ctypes.data == t.data_ptr()
    a.slot_view(1).fill_(1)
    assert t.view(torch.uint8).reshape(4, 1024)[1].eq(1).all()  # same memory
    n = np.zeros(4096, np.uint8)
    assert HostArena.register("n", n, slot_bytes=512).num_slots == 8
    with pytest.raises(ArenaError, match="whole number"):
        HostArena.register("odd", n, slot_bytes=1000)
    with pytest.raises(ArenaError, match="contiguous"):
        HostArena.register("strided", np.zeros((8, 8), np.uint8)[:, ::2], slot_bytes=8)


@pytest.mark.skipif(cuda_available(), reason="pinning would succeed")
def test_pin_failure_says_what_was_asked_and_what_is_pinned() -> None:
    pytest.importorskip("cupy")
    a = HostArena("big", slot_bytes=1 << 12, num_slots=16, chunk_bytes=1 << 14)
    before = pinned_bytes()
    with pytest.raises(PageLockError) as info:
        a.ensure_pinned(np.array([5]))
    msg = str(info.value)
    assert "cannot pin 16384 B" in msg and "chunk 1 of 4" in msg
    assert "pinned now: 0 of 65536 B in this arena" in msg and "RLIMIT_MEMLOCK" in msg
    assert isinstance(info.value, ArenaError) and pinned_bytes() == before
