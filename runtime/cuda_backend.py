"""The cuda backend: CuPy streams and events, device and pinned host arenas, batched copies.

    backend = CudaBackend(device=0)                       # or create_backend("cuda")
    dev  = backend.create_arena("dev", slot, n)           # one cudaMalloc; .tensor via DLPack
    host = backend.create_arena("host", slot, m, kind="pinned")   # pinned lazily, 1 GiB chunks
    compute = backend.compute_stream(torch.cuda.current_stream())
    engine.submit(dev, ids, host, hids, after=[compute.record_event()])   # D2H after compute
    compute.wait_event(load.event)                        # compute after the load

Importing this module never imports CuPy; constructing `CudaBackend` does, and raises
BackendUnavailableError saying what is missing. Each engine batch is one `copy_slots` call on the
stream's launcher thread: one kernel launch (or one cudaMemcpyAsync per coalesced run), one event,
one synchronize with the GIL released; the engine's completion follows (see docs/cuda.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.transports.errors import InvalidInputError

from .arena import Arena
from .backend import DEFAULT_TIMEOUT_S, Backend, CopyInfo, Event
from .cpu_copy import coalesce_runs, copy_rows
from .cuda_arena import DEFAULT_CHUNK_BYTES, DeviceArena, HostArena
from .cuda_env import cuda_available, import_cupy
from .cuda_kernels import KERNEL_SOURCE, choose_method, launch_plans, split_runs, vector_width
from .cuda_stream import ComputeStream, CudaStream, check_strategy
from .errors import ArenaError, ArenaMismatchError, EngineClosedError
from .freelist import SlotIds

__all__ = ["CUDA_BACKEND_READY", "DEFAULT_WAIT_STRATEGY", "CudaBackend", "cuda_available"]

#: The cuda backend is implemented: `create_backend("auto")` picks it when a device is usable.
CUDA_BACKEND_READY = True

#: Default event-waiting strategy. Provisional: `benchmarks/gpu_check.py` measures both and
#: prints the one `pick_wait_strategy` recommends; see docs/cuda.md.
DEFAULT_WAIT_STRATEGY = "thread"

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the addresses (UVA)


@dataclass(slots=True)
class _Staging:
    """Per-batch scratch: slot ids for the kernel (pinned, copied to the device), a host buffer
    for host-to-host batches, and the event the batch is synchronized on."""

    nbytes: int
    ids_host: Any = None  # numpy int64 view of pinned memory
    ids_pinned: Any = None
    ids_dev: Any = None  # cupy.cuda.Memory
    capacity: int = 0  # id pairs
    host: Any = None
    done: Any = None  # cupy.cuda.Event


def _kind(arena: Arena) -> str:
    return str(getattr(arena, "kind", "pageable"))


class CudaBackend(Backend):
    """CUDA backend on one device.

    `wait_strategy`: "thread" or "poll" (see `runtime.cuda_stream`). `copy_method`: "auto",
    "kernel" or "memcpy" (see `runtime.cuda_kernels.choose_method`). `blocking_sync`: events
    sleep instead of spinning when synchronized. `host_chunk_bytes`: pinning granularity.
    Raises BackendUnavailableError when CuPy or a device is missing, ValueError for bad options.
    """

    name = "cuda"

    def __init__(
        self,
        device: int = 0,
        *,
        wait_strategy: str = DEFAULT_WAIT_STRATEGY,
        copy_method: str = "auto",
        blocking_sync: bool = True,
        host_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        run_min_bytes: int = 1 << 20,
        wait_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        check_strategy(wait_strategy)
        if copy_method not in ("auto", "kernel", "memcpy"):
            raise InvalidInputError(f"unknown copy method {copy_method!r}")
        cupy = import_cupy()
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise InvalidInputError(f"device {device} not in [0, {count})")
        self.device = device
        self.wait_strategy = wait_strategy
        self.copy_method = copy_method
        self.blocking_sync = blocking_sync
        self.host_chunk_bytes = host_chunk_bytes
        self.run_min_bytes = run_min_bytes
        self.wait_timeout = wait_timeout
        rt = cupy.cuda.runtime
        # Kernels address pinned host memory by its host pointer (mapped, UVA): needs this.
        self.mapped_host_ok = bool(
            rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, device)
        )
        self._kernels: dict[str, Any] = {}
        self._streams: list[CudaStream] = []
        self._compute: list[ComputeStream] = []
        self._default_compute: ComputeStream | None = None
        self._default_compute_src: Any = None
        self._host_arenas: list[HostArena] = []
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"CudaBackend(device={self.device}, wait={self.wait_strategy!r}, "
            f"copy={self.copy_method!r}, streams={len(self._streams)})"
        )

    # Arenas

    def create_arena(
        self, name: str, slot_bytes: int, num_slots: int, *, kind: str = "device"
    ) -> Arena:
        """An arena of `kind` "device" (cudaMalloc), "pinned" (host, pinned lazily in chunks)
        or "pageable" (host, never pinned: for comparisons). Raises ArenaError.
        """
        if not isinstance(slot_bytes, int) or not isinstance(num_slots, int):
            raise ArenaError(f"arena {name!r}: slot_bytes and num_slots must be ints")
        if kind == "device":
            return DeviceArena(name, slot_bytes, num_slots, device=self.device, backend=self.name)
        if kind in ("pinned", "pageable"):
            return self.create_host_arena(name, slot_bytes, num_slots, pinned=kind == "pinned")
        raise ArenaError(f"arena {name!r}: unknown kind {kind!r} (device, pinned, pageable)")

    def create_host_arena(
        self, name: str, slot_bytes: int, num_slots: int, *, pinned: bool = True
    ) -> HostArena:
        """A host arena; pinned chunk by chunk on first use unless `pinned=False`."""
        arena = HostArena(
            name,
            slot_bytes,
            num_slots,
            pinned=pinned,
            chunk_bytes=self.host_chunk_bytes,
            backend=self.name,
        )
        self._host_arenas.append(arena)
        return arena

    def register_host_arena(self, name: str, buffer: Any, slot_bytes: int) -> HostArena:
        """Wrap an existing host buffer as a pinned arena (cudaHostRegister, chunk by chunk)."""
        arena = HostArena.register(
            name, buffer, slot_bytes, chunk_bytes=self.host_chunk_bytes, backend=self.name
        )
        self._host_arenas.append(arena)
        return arena

    # Streams

    def create_stream(self, name: str) -> CudaStream:
        if self._closed:
            raise EngineClosedError("cuda backend is closed")
        stream = CudaStream(
            name,
            device=self.device,
            strategy=self.wait_strategy,
            blocking_sync=self.blocking_sync,
            wait_timeout=self.wait_timeout,
        )
        self._streams.append(stream)
        return stream

    def compute_stream(self, stream: Any = None) -> ComputeStream:
        """Wrap the caller's compute stream: a torch.cuda.Stream, a cupy stream, a raw
        cudaStream_t, or None for CuPy's current stream on this device.
        """
        if self._closed:
            raise EngineClosedError("cuda backend is closed")
        cs = ComputeStream(
            stream,
            device=self.device,
            strategy=self.wait_strategy,
            blocking_sync=self.blocking_sync,
            wait_timeout=self.wait_timeout,
        )
        self._compute.append(cs)
        return cs

    def compute_event(self) -> Event | None:
        """An event recorded now on torch's current stream (or CuPy's when torch has none)."""
        stream: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                stream = torch.cuda.current_stream(self.device)
        except ImportError:  # pragma: no cover - torch is a dependency
            stream = None
        if self._default_compute is None or self._default_compute_src is not stream:
            self._default_compute = self.compute_stream(stream)
            self._default_compute_src = stream
        return self._default_compute.record_event()

    # Copies

    def create_staging(self, nbytes: int) -> _Staging:
        return _Staging(nbytes=nbytes)

    def kernel(self, name: str) -> Any:
        """The compiled copy kernel `name` (compiled with NVRTC on first use, then cached)."""
        k = self._kernels.get(name)
        if k is None:
            import cupy

            k = cupy.RawKernel(KERNEL_SOURCE, name)
            self._kernels[name] = k
        return k

    def copy_slots(
        self, src: Arena, src_ids: SlotIds, dst: Arena, dst_ids: SlotIds, staging: Any
    ) -> CopyInfo:
        """Copy one batch and return once it has finished on the device.

        Runs on the calling thread (a stream's launcher: its CUDA stream is current). Raises
        ArenaMismatchError, PageLockError, or CuPy's error for a failed launch.
        """
        if src.slot_bytes != dst.slot_bytes:
            raise ArenaMismatchError(
                f"slot sizes differ: {src.name!r} {src.slot_bytes} B, "
                f"{dst.name!r} {dst.slot_bytes} B"
            )
        for a in (src, dst):
            if isinstance(a, DeviceArena) and a.device != self.device:
                raise ArenaMismatchError(
                    f"arena {a.name!r} is on device {a.device}, the backend on {self.device}"
                )
        if not isinstance(staging, _Staging):
            staging = self.create_staging(1 << 20)
        slot = src.slot_bytes
        method = choose_method(
            _kind(src),
            _kind(dst),
            src_ids,
            dst_ids,
            slot,
            method=self.copy_method,
            run_min_bytes=self.run_min_bytes,
            kernel_ok=self.mapped_host_ok,
        )
        if method == "host":
            if staging.host is None:
                staging.host = np.zeros(max(staging.nbytes, slot), dtype=np.uint8)
            runs, kernel = copy_rows(src.array, src_ids, dst.array, dst_ids, staging.host)
            return CopyInfo(runs=runs, kernel=f"host-{kernel}")
        for a, ids in ((src, src_ids), (dst, dst_ids)):
            if isinstance(a, HostArena):
                a.ensure_pinned(ids)
        import cupy

        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            if method == "memcpy":
                runs = self._copy_runs(src, src_ids, dst, dst_ids, stream)
            else:
                runs = self._launch(src, src_ids, dst, dst_ids, staging, stream)
            if staging.done is None:
                staging.done = cupy.cuda.Event(block=self.blocking_sync, disable_timing=True)
            staging.done.record(stream)
            staging.done.synchronize()  # GIL released; the batch is complete on return
        return CopyInfo(runs=runs, kernel=f"cuda-{method}")

    def _copy_runs(
        self, src: Arena, src_ids: SlotIds, dst: Arena, dst_ids: SlotIds, stream: Any
    ) -> int:
        import cupy

        slot = src.slot_bytes
        s0, d0, n = coalesce_runs(src_ids, dst_ids)
        s0, d0, n = split_runs(
            s0, d0, n, getattr(src, "chunk_slots", None), getattr(dst, "chunk_slots", None)
        )
        sp, dp = _address(src), _address(dst)
        memcpy = cupy.cuda.runtime.memcpyAsync
        for s, d, k in zip(s0.tolist(), d0.tolist(), n.tolist()):
            memcpy(dp + d * slot, sp + s * slot, k * slot, _MEMCPY_DEFAULT, stream.ptr)
        return int(n.size)

    def _launch(
        self,
        src: Arena,
        src_ids: SlotIds,
        dst: Arena,
        dst_ids: SlotIds,
        staging: _Staging,
        stream: Any,
    ) -> int:
        import cupy

        count = int(src_ids.size)
        if count == 0:
            return 0
        _ensure_ids_capacity(staging, count)
        staging.ids_host[:count] = src_ids
        staging.ids_host[count : 2 * count] = dst_ids
        dev_ids = int(staging.ids_dev.ptr)
        # One small H2D copy of the ids, then the kernel, both in stream order.
        cupy.cuda.runtime.memcpyAsync(
            dev_ids, int(staging.ids_host.ctypes.data), 16 * count, _MEMCPY_DEFAULT, stream.ptr
        )
        sp, dp = _address(src), _address(dst)
        slot = src.slot_bytes
        vec = vector_width(slot, sp, dp)
        for plan in launch_plans(count, slot, vec):
            self.kernel(plan.kernel)(
                plan.grid,
                plan.block,
                (
                    np.uint64(sp),
                    np.uint64(dp),
                    np.uint64(dev_ids + 8 * plan.first),
                    np.uint64(dev_ids + 8 * (count + plan.first)),
                    np.int64(plan.units_per_slot),
                    np.int64(plan.units_per_chunk),
                    np.int64(plan.chunks_per_page),
                ),
            )
        _, _, lengths = coalesce_runs(src_ids, dst_ids)
        return int(lengths.size)

    def close(self) -> None:
        """Stop every stream (after its queued work) and unpin host arenas. Idempotent."""
        self._closed = True
        for stream in self._streams:
            stream.close()
        self._streams.clear()
        for cs in self._compute:
            cs.close()
        self._compute.clear()
        for arena in self._host_arenas:
            arena.close()
        self._host_arenas.clear()


def _address(arena: Arena) -> int:
    if isinstance(arena, DeviceArena | HostArena):
        return arena.ptr
    return int(arena.array.ctypes.data)


def _ensure_ids_capacity(staging: _Staging, count: int) -> None:
    # Grown, never reused in pieces: the pinned ids must not change before their copy has run.
    if staging.capacity >= count:
        return
    import cupy

    cap = max(1024, 1 << (count - 1).bit_length())
    pinned = cupy.cuda.alloc_pinned_memory(16 * cap)
    staging.ids_pinned = pinned
    staging.ids_host = np.frombuffer(pinned, dtype=np.int64, count=2 * cap)
    staging.ids_dev = cupy.cuda.Memory(16 * cap)
    staging.capacity = cap
