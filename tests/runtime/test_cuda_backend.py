"""The cuda backend on a GPU: orderings, event waiting, pinning, DLPack, IPC (skip without one)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pytest

from tierkv.runtime import ArenaError, Priority, TransferEngine
from tierkv.runtime.cuda_env import cuda_available

cupy = pytest.importorskip("cupy")
if not cuda_available():
    pytest.skip("needs CuPy and a CUDA device", allow_module_level=True)

from tierkv.runtime.cuda_arena import DeviceArena, HostArena  # noqa: E402
from tierkv.runtime.cuda_backend import CudaBackend  # noqa: E402
from tierkv.runtime.cuda_ipc import ArenaDescriptor, export_arena, open_arena  # noqa: E402

pytestmark = pytest.mark.cuda

# Spins ~`spin` clock cycles, then fills p[0:n] with v: a "compute" slow enough to race with.
SLOW_FILL = cupy.RawKernel(
    r"""
extern "C" __global__ void slow_fill(unsigned char* p, long long n, unsigned char v,
                                     long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    for (long long i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}
""",
    "slow_fill",
)
SPIN = 200_000_000  # ~0.1 s at 2 GHz


def slow_fill(ptr: int, n: int, value: int, stream: Any, spin: int = SPIN) -> None:
    with stream:
        SLOW_FILL((1,), (256,), (np.uint64(ptr), np.int64(n), np.uint8(value), np.int64(spin)))


@pytest.fixture(params=["thread", "poll"])
def cuda(request: pytest.FixtureRequest) -> Any:
    b = CudaBackend(wait_strategy=request.param)
    yield b
    b.close()


async def test_d2h_waits_on_the_compute_event(cuda: CudaBackend) -> None:
    dev = cuda.create_arena("dev", 1 << 16, 4)
    host = cuda.create_arena("host", 1 << 16, 4, kind="pinned")
    d, h = dev.allocate(1), host.allocate(1)
    compute = cuda.compute_stream(cupy.cuda.Stream(non_blocking=True))
    assert isinstance(dev, DeviceArena)
    slow_fill(dev.slot_address(int(d[0])), dev.slot_bytes, 9, compute.cuda)
    wrote = compute.record_event()
    async with TransferEngine(cuda) as engine:
        await engine.submit(dev, d, host, h, priority=Priority.WRITEBACK, after=[wrote])
    assert (host.array[h[0]] == 9).all()  # the copy saw the compute's bytes, not zeros


async def test_use_of_a_loaded_page_waits_on_its_load_event(cuda: CudaBackend) -> None:
    dev = cuda.create_arena("dev", 1 << 16, 4)
    assert isinstance(dev, DeviceArena)
    load_stream = cuda.create_stream("h2d")
    ptr = dev.slot_address(0)
    load_stream.enqueue(lambda: slow_fill(ptr, dev.slot_bytes, 5, load_stream.cuda))
    loaded = load_stream.record_event()
    compute = cuda.compute_stream(cupy.cuda.Stream(non_blocking=True))
    compute.wait_event(loaded)  # device-side; waits (bounded) for the record first
    with compute.cuda:
        used = dev.array[0].copy()  # the "use", on the compute stream
    compute.cuda.synchronize()
    assert (cupy.asnumpy(used) == 5).all()
    await loaded.wait(timeout=30)


def test_wait_on_an_unrecorded_event_waits_for_its_record(cuda: CudaBackend) -> None:
    dev = cuda.create_arena("dev", 4096, 2)
    assert isinstance(dev, DeviceArena)
    s = cuda.create_stream("s")
    gate = threading.Event()
    s.enqueue(lambda: gate.wait(10))  # the launcher is held: the next record is late
    ptr = dev.slot_address(1)
    s.enqueue(lambda: slow_fill(ptr, 4096, 3, s.cuda, spin=1000))
    ev = s.record_event()
    threading.Timer(0.1, gate.set).start()
    compute = cuda.compute_stream(cupy.cuda.Stream(non_blocking=True))
    compute.wait_event(ev)
    with compute.cuda:
        used = dev.array[1].copy()
    compute.cuda.synchronize()
    assert (cupy.asnumpy(used) == 3).all()


async def test_event_wait_keeps_the_loop_running(cuda: CudaBackend) -> None:
    dev = cuda.create_arena("dev", 4096, 1)
    assert isinstance(dev, DeviceArena)
    s = cuda.create_stream("s")
    s.enqueue(lambda: slow_fill(dev.ptr, 4096, 1, s.cuda))
    ev = s.record_event()
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not ev.query():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    await asyncio.gather(ev.wait(timeout=30), ticker())
    assert len(gaps) > 10 and max(gaps) < 0.05


async def test_pinned_host_is_registered_lazily_per_chunk() -> None:
    b = CudaBackend(host_chunk_bytes=4 * 4096)
    host = b.create_arena("host", 4096, 16, kind="pinned")
    dev = b.create_arena("dev", 4096, 16)
    assert isinstance(host, HostArena)
    host.allocate(16)
    dev.allocate(16)
    assert host.pinned_nbytes == 0
    async with TransferEngine(b) as engine:
        await engine.transfer(host, [5, 6], dev, [0, 1])
    assert host.pinned_nbytes == 4 * 4096 and host._registered.tolist() == [0, 1, 0, 0]
    host.pin_all()
    assert host.pinned_nbytes == host.nbytes
    b.close()
    assert host.pinned_nbytes == 0


def test_device_arena_is_shared_with_torch_without_copy(cuda: CudaBackend) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    dev = cuda.create_arena("dev", 256, 4)
    assert isinstance(dev, DeviceArena)
    t = dev.tensor
    assert t.is_cuda and t.shape == (4, 256) and t.data_ptr() == dev.ptr
    t[2].fill_(7)
    torch.cuda.synchronize()
    assert int(dev.array[2].sum()) == 7 * 256


def test_device_oom_says_how_much_is_free() -> None:
    b = CudaBackend()
    with pytest.raises(ArenaError, match=r"cudaMalloc of \d+ B failed.*free"):
        b.create_arena("huge", 1 << 30, 1 << 20)  # 1 PiB
    b.close()


def _ipc_child(desc: ArenaDescriptor, index: int, q: Any) -> None:
    try:
        import cupy as cp

        from tierkv.runtime.cuda_ipc import open_arena as open_

        with open_(desc) as arena:
            s = cp.cuda.Stream(non_blocking=True)
            arena.wait(index, s)  # the exporter's write, on the device
            with s:
                got = cp.asnumpy(arena.array[1])
                arena.array[2].fill(42)  # write back in place
            s.synchronize()
        q.put(("ok", got.tobytes()))
    except Exception as exc:  # report, do not hang the parent
        q.put(("error", repr(exc)))


def test_ipc_second_process_reads_and_writes_in_place() -> None:
    b = CudaBackend()
    dev = b.create_arena("dev", 4096, 4)
    assert isinstance(dev, DeviceArena)
    exp = export_arena(dev, num_events=2)
    writer = cupy.cuda.Stream(non_blocking=True)
    slow_fill(dev.slot_address(1), 4096, 11, writer, spin=SPIN // 4)
    index = exp.record(writer)
    with pytest.raises(ArenaError, match="exported it"):
        open_arena(exp.descriptor)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(exp.descriptor, index, q))
    p.start()
    status, payload = q.get(timeout=120)
    p.join(60)
    assert status == "ok", payload
    assert payload == bytes([11]) * 4096
    assert int(dev.array[2].sum()) == 42 * 4096
    assert exp.descriptor.slot_offset(3) == 3 * 4096
    b.close()
