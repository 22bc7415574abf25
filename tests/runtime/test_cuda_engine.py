"""The transfer engine, parametrized over the cpu and cuda backends (cuda cases need a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tierkv.runtime import Arena, Backend, Priority, TransferEngine, create_backend

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=BACKENDS)
def any_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = create_backend(request.param)
    yield b
    b.close()


def make(backend: Backend, name: str, slot: int, n: int, kind: str) -> Arena:
    """`kind` "device" or a host kind; on cpu every arena is host memory."""
    if backend.name == "cpu":
        return backend.create_arena(name, slot, n)
    return backend.create_arena(name, slot, n, kind=kind)  # type: ignore[call-arg]


def write(arena: Arena, ids: np.ndarray, data: np.ndarray) -> None:
    arr: Any = arena.array
    if isinstance(arr, np.ndarray):
        arr[ids] = data
    else:
        import cupy

        arr[cupy.asarray(ids)] = cupy.asarray(data)


def read(arena: Arena, ids: np.ndarray) -> np.ndarray:
    arr: Any = arena.array
    if isinstance(arr, np.ndarray):
        return arr[ids].copy()
    import cupy

    return cupy.asnumpy(arr[cupy.asarray(ids)])


PATTERNS = {
    "adjacent": lambda rng: (np.arange(12), np.arange(12) + 3),
    "scattered": lambda rng: (rng.permutation(40)[:12], rng.permutation(40)[:12]),
    "single": lambda rng: (np.array([7]), np.array([0])),
}


@pytest.mark.parametrize("host_kind", ["pinned", "pageable"])
@pytest.mark.parametrize("slot", [48, 16 << 10])
@pytest.mark.parametrize("pattern", list(PATTERNS))
async def test_round_trip_host_device_host(
    any_backend: Backend, pattern: str, slot: int, host_kind: str
) -> None:
    if any_backend.name == "cpu" and host_kind == "pageable":
        pytest.skip("one host kind on cpu")
    rng = np.random.default_rng(4)
    host = make(any_backend, "host", slot, 40, host_kind)
    dev = make(any_backend, "dev", slot, 40, "device")
    back = make(any_backend, "back", slot, 40, host_kind)
    for a in (host, dev, back):
        a.allocate(40)
    s_ids, d_ids = (np.asarray(x, np.int64) for x in PATTERNS[pattern](rng))
    data = rng.integers(0, 256, (s_ids.size, slot), np.uint8)
    write(host, s_ids, data)
    async with TransferEngine(any_backend, max_inflight=2) as engine:
        load = engine.submit(host, s_ids, dev, d_ids, priority=Priority.DEMAND)
        store = engine.submit(dev, d_ids, back, s_ids, priority=Priority.WRITEBACK, after=[load])
        stats = await store
    assert np.array_equal(read(dev, d_ids), data)
    assert np.array_equal(read(back, s_ids), data)
    untouched = np.setdiff1d(np.arange(40), s_ids)
    assert not read(back, untouched).any()
    assert stats.pages == s_ids.size and stats.runs >= 1 and stats.kernel


async def test_device_to_device_batch(any_backend: Backend) -> None:
    rng = np.random.default_rng(5)
    a = make(any_backend, "a", 4096, 64, "device")
    b = make(any_backend, "b", 4096, 64, "device")
    a.allocate(64)
    b.allocate(64)
    s_ids, d_ids = rng.permutation(64)[:50], rng.permutation(64)[:50]
    data = rng.integers(0, 256, (50, 4096), np.uint8)
    write(a, s_ids, data)
    async with TransferEngine(any_backend) as engine:
        await engine.transfer(a, s_ids, b, d_ids)
    assert np.array_equal(read(b, d_ids), data)
