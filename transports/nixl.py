"""NIXL: one-sided reads and writes through NVIDIA's transfer library (PyPI ``nixl-cu12``).

Each transport owns one NIXL agent with the UCX backend. UCX picks the wire: RDMA or NVLink on
GPU hosts, cross-memory attach or TCP on plain hosts (``UCX_TLS=tcp`` forces TCP). The target's
CPU is not involved per op; its UCX progress thread serves emulated transports.

Metadata (`metadata()`) carries the agent's NIXL metadata: connection info plus the regions
registered so far. A region registered later still works: its descriptor's `handle` carries the
region's address and its partial NIXL metadata, loaded by an initiator on first use::

    handle = "<addr hex>:<device id>:<DRAM|VRAM>:<partial metadata hex>"

A batch becomes one NIXL transfer per (peer, local memory type, remote memory type), normally
one. The event loop builds the descriptor lists and posts the transfer; a post that UCX
completes in place (cross-memory attach copies inside the call, like shm's memcpy) settles at
once, with no thread hand-off. A transfer still in progress goes to the engine thread, which
polls its state with a short backoff (20 us doubling to 1 ms; no busy spinning), polls
notifications while someone awaits one, and settles the asyncio futures::

    event loop                                engine thread                NIXL / UCX
    read(ops): initialize_xfer, transfer ───────────────────────────────>  bytes move
      "DONE" -> settled                       (not involved)
      "PROC" -> job ────────────────────────> check_xfer_state, backoff
    await fut  <──── call_soon_threadsafe ─── "DONE" / "ERR"
    get_notification() <──────────────────── get_new_notifs (while awaited)

A notification is NIXL's per-transfer message, sent by NIXL after the transfer's bytes landed.
Messages carry a one-byte tag: 1 a user's notification (so `notify=b""` is still delivered),
2 "region <id> is deregistered", 3 "hello, here is my metadata" (sent by `add_peer`, so the
target can announce deregistrations to the initiators that know it). One-sided reads of a
deregistered region are a fault UCX answers by failing the whole connection, so an owner
announces a deregistration to every agent it knows before dropping the memory, and an
initiator refuses descriptors of announced regions with RemoteAccessError. The announcement is
asynchronous: a read racing it can still fail the connection (PeerError).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

import numpy as np

from .base import DEFAULT_TIMEOUT_S, Direction, Transport
from .errors import (
    InvalidInputError,
    PeerError,
    RegionError,
    RemoteAccessError,
    TransferTimeoutError,
    TransportError,
)
from .handle import BatchHandle
from .nixl_engine import (
    DEREG_TAG,
    HELLO_TAG,
    NOTE_TAG,
    START_TIMEOUT_S,
    NixlEngine,
    NixlJob,
    agent_name,
    load_nixl,
    new_agent,
)
from .regions import Capabilities, Region, RegionDescriptor, TransferOp, as_byte_view

__all__ = ["NixlTransport", "load_nixl"]


class NixlTransport(Transport):
    """One-sided transport over NIXL's UCX backend (hosts and GPUs, across the network).

    Host memory (`"host"`, `"pinned"`) registers any writable C-contiguous buffer; `"device"`
    registers a CUDA buffer (anything with ``__cuda_array_interface__``, e.g. a CuPy array or a
    torch tensor) where NIXL's UCX backend was built with CUDA. Every registered region can be
    targeted by peers. Raises TransportError at construction when NIXL is not installed.

    `backend`: the NIXL plugin ("UCX"); `num_threads`: UCX worker threads (0: NIXL's default);
    `progress_thread`: run UCX's progress thread, which serves peers' one-sided ops where UCX
    emulates them (UCX over TCP) and completes our transfers in the background. An agent that
    only initiates, or whose peers reach it over RDMA or cross-memory attach only, can turn it
    off: the engine thread then drives UCX while transfers are in flight and every 4-20 ms
    otherwise, and posts no longer contend with the thread for UCX's worker lock;
    `progress_delay_us`: how long the progress thread sleeps in poll() at most when nothing
    happens (0 makes it spin a core, NIXL's Python default).
    """

    kind = "nixl"
    capabilities = Capabilities(frozenset({"host", "pinned", "device"}), "native", "network")

    def __init__(
        self,
        name: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        backend: str = "UCX",
        num_threads: int = 0,
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
    ) -> None:
        super().__init__(name, timeout=timeout)
        if progress_delay_us < 0:
            raise InvalidInputError("progress_delay_us must be >= 0")
        self._delay_us = progress_delay_us
        self._progress_thread = progress_thread
        self._api = load_nixl()
        self._backend = backend
        self._num_threads = num_threads
        self._agent: Any = None
        self._engine: NixlEngine | None = None
        self._reg: dict[int, Any] = {}  # region id -> NIXL registration list
        self._base: dict[int, tuple[int, int, str]] = {}  # region id -> (address, device, seg)
        self._gone: set[tuple[str, int]] = set()  # peers' regions announced as deregistered

    # -- agent ---------------------------------------------------------------------------------

    def _ensure_agent(self) -> Any:
        if self._agent is None:
            api = self._api
            config = api.nixl_agent_config(
                enable_prog_thread=self._progress_thread,
                enable_listen_thread=False,
                num_threads=self._num_threads,
                backends=[self._backend],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            try:
                agent = new_agent(api, self.name, config, self._delay_us)
            except Exception as exc:
                raise TransportError(f"cannot create the NIXL agent {self.name!r}: {exc}") from exc
            if self._backend not in agent.backends:
                raise TransportError(
                    f"NIXL backend {self._backend!r} is not available "
                    f"(plugins: {agent.get_plugin_list()}; NIXL_PLUGIN_DIR?)"
                )
            self._agent = agent
        return self._agent

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        limit = max(self.timeout, START_TIMEOUT_S)  # UCX start-up is slow on a loaded host
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self._ensure_agent), limit)
        except TimeoutError:
            raise TransferTimeoutError(f"NIXL agent not started after {limit:g} s") from None
        self._engine = NixlEngine(self._agent, self._on_message)
        self._engine.start()

    def _engine_or_raise(self) -> NixlEngine:
        if self._engine is None:
            raise TransportError(f"transport {self.name!r} is not started (use `async with`)")
        return self._engine

    async def _close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.stop()
        await asyncio.get_running_loop().run_in_executor(None, engine.join, self.timeout)
        for peer in set(self._peers) | engine.known:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)

    async def aclose(self) -> None:
        """Abort in-flight transfers, deregister every region, drop peers and the NIXL agent."""
        try:
            await super().aclose()
        finally:
            self._agent = None  # the last reference: NIXL tears down its backend and threads

    # -- regions -------------------------------------------------------------------------------

    def register_memory(self, buffer: Any, kind: str = "host") -> Region:
        """Register `buffer` with NIXL; peers may target it through its descriptor.

        `kind` "device" takes a CUDA buffer (``__cuda_array_interface__``). Raises RegionError
        (bad buffer, unsupported kind, NIXL refused the registration) or ClosedError.
        """
        if kind != "device":
            return super().register_memory(buffer, kind)
        self._check_open()
        address, size, device = _cuda_buffer(buffer)
        rid = next(self._region_ids)
        handle = self._nixl_register(rid, address, size, device, "VRAM")
        region = Region(memoryview(b""), RegionDescriptor(self.name, rid, size, kind, handle), self)
        self._regions[rid] = region
        return region

    def _prepare_region(self, buffer: Any, region_id: int) -> tuple[memoryview, str]:
        view = as_byte_view(buffer)
        if view.nbytes == 0:
            return view, ""  # nothing to target
        probe = np.frombuffer(view, np.uint8)
        address = int(probe.ctypes.data)
        del probe  # drop the export so that deregistering can release the view
        return view, self._nixl_register(region_id, address, view.nbytes, 0, "DRAM")

    def _nixl_register(self, rid: int, address: int, size: int, device: int, seg: str) -> str:
        agent = self._ensure_agent()
        if seg == "VRAM" and "VRAM_SEG" not in agent.get_backend_mem_types(self._backend):
            raise RegionError(f"NIXL backend {self._backend} cannot register device memory")
        try:
            reg = agent.register_memory([(address, size, device, "")], seg)
        except Exception as exc:
            raise RegionError(f"NIXL refused to register {size} bytes of {seg}: {exc}") from exc
        try:
            partial = agent.get_partial_agent_metadata(reg, False)
        except Exception as exc:
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg)
            raise RegionError(f"NIXL has no metadata for {size} bytes of {seg}: {exc}") from exc
        self._reg[rid] = reg
        self._base[rid] = (address, device, seg)
        return f"{address:x}:{device}:{seg}:{bytes(partial).hex()}"

    def _on_deregister(self, region: Region) -> None:
        reg = self._reg.pop(region.region_id, None)
        self._base.pop(region.region_id, None)
        if reg is not None and self._engine is not None:  # tell initiators before it goes
            message = DEREG_TAG + region.region_id.to_bytes(8, "big")
            for agent in tuple(self._engine.known):
                with contextlib.suppress(Exception):
                    self._agent.send_notif(agent, message)
        if reg is not None:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)

    # -- peers ---------------------------------------------------------------------------------

    def _peer_fields(self) -> dict[str, Any]:
        return {"nixl": bytes(self._ensure_agent().get_agent_metadata())}

    async def _add_peer(self, info: dict[str, Any]) -> None:
        agent, md = info["agent"], info.get("nixl")
        if not isinstance(md, bytes):
            raise PeerError(f"nixl peer {agent!r} sent no NIXL metadata")
        engine = self._engine_or_raise()

        def load() -> None:  # on the engine thread
            a = self._agent
            if agent in engine.known:  # re-added, or it introduced itself with a hello
                with contextlib.suppress(Exception):
                    a.remove_remote_agent(agent)
                engine.known.discard(agent)
            before = set(engine.known)
            name = agent_name(a.add_remote_agent(md))
            if name != agent:
                if name not in before:
                    with contextlib.suppress(Exception):
                        a.remove_remote_agent(name)
                raise PeerError(f"NIXL metadata names {name!r}, not {agent!r}")
            a.make_connection(agent)
            engine.known.add(agent)
            a.send_notif(agent, HELLO_TAG + bytes(a.get_agent_metadata()))

        if agent in self._peers or agent in engine.known:
            engine.forget_sections()  # loaded again on first use
        try:
            await engine.call(load, self.timeout)
        except TransferTimeoutError as exc:
            raise PeerError(f"nixl peer {agent!r} did not connect in {self.timeout:g} s") from exc
        except TransportError:
            raise
        except Exception as exc:
            raise PeerError(f"cannot add nixl peer {agent!r}: {exc}") from exc

    def _on_message(self, peer: str, message: bytes) -> None:
        if message[:1] == NOTE_TAG:
            self.deliver_notification(peer, message[1:])
        elif message[:1] == DEREG_TAG and len(message) == 9:
            self._gone.add((peer, int.from_bytes(message[1:], "big")))

    async def get_notification(self, timeout: float | None = None) -> Any:
        """The next notification a peer attached to a transfer (delivered after its bytes
        landed); raises TransferTimeoutError after `timeout` s (default: the transport's)."""
        self._check_open()
        engine = self._engine_or_raise()
        engine.watch_notes(+1)
        try:
            return await super().get_notification(timeout)
        finally:
            engine.watch_notes(-1)

    # -- transfers -----------------------------------------------------------------------------

    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        engine = self._engine_or_raise()
        note = b"" if notify is None else NOTE_TAG + bytes(notify)
        jobs = [
            NixlJob("READ" if direction == "read" else "WRITE", peer, local, remote, sections, note)
            for peer, local, remote, sections in self._batches(ops)
        ]
        for job in jobs:
            handle.on_abort(functools.partial(engine.abort, job))
            engine.post(job)
        if notify is not None:  # a peer all of whose ops were empty still gets the note
            moving = {job.peer for job in jobs}
            for peer in {op.remote.agent for op in ops} - moving:
                await engine.call(
                    functools.partial(self._agent.send_notif, peer, note), self.timeout
                )
        try:
            if len(jobs) == 1:
                await jobs[0].future
            else:
                await asyncio.gather(*(job.future for job in jobs))
        finally:
            for job in jobs:  # a sibling failed or we were cancelled: stop the rest
                engine.abort(job)

    def _batches(
        self, ops: list[TransferOp]
    ) -> list[tuple[str, tuple[str, np.ndarray], tuple[str, np.ndarray], list[bytes]]]:
        """Descriptor arrays per (peer, local memory type, remote memory type)."""
        rows: dict[tuple[str, str, str], tuple[list[list[int]], list[list[int]], set[bytes]]] = {}
        for local, lo, remote, ro, n in ops:
            if n == 0:
                continue
            base, dev, lseg = self._base.get(local.region_id, (0, 0, ""))
            if not lseg:
                raise RegionError(f"{local!r} is not registered with NIXL")
            if (remote.agent, remote.region_id) in self._gone:
                raise RemoteAccessError(
                    f"region {remote.region_id} of {remote.agent!r} was deregistered by its owner"
                )
            raddr, rdev, rseg, md = _parse_handle(remote)
            lrows, rrows, sections = rows.setdefault((remote.agent, lseg, rseg), ([], [], set()))
            lrows.append([base + lo, n, dev])
            rrows.append([raddr + ro, n, rdev])
            sections.add(md)
        return [
            (
                peer,
                (lseg, np.array(lrows, dtype=np.uint64)),
                (rseg, np.array(rrows, dtype=np.uint64)),
                sorted(sections),
            )
            for (peer, lseg, rseg), (lrows, rrows, sections) in rows.items()
        ]


def _parse_handle(desc: RegionDescriptor) -> tuple[int, int, str, bytes]:
    """(address, device, NIXL segment, partial metadata) of a peer's region descriptor."""
    try:
        addr, dev, seg, md = desc.handle.split(":", 3)
        parsed = int(addr, 16), int(dev), seg, bytes.fromhex(md)
    except ValueError:
        raise RemoteAccessError(_not_nixl(desc)) from None
    if seg not in ("DRAM", "VRAM") or not parsed[3] or parsed[0] <= 0 or parsed[1] < 0:
        raise RemoteAccessError(_not_nixl(desc))
    return parsed


def _not_nixl(desc: RegionDescriptor) -> str:
    return f"region {desc.region_id} of {desc.agent!r} has no NIXL handle ({desc.handle[:24]!r}...)"


def _cuda_buffer(buffer: Any) -> tuple[int, int, int]:
    """(address, size, device id) of a contiguous CUDA buffer. Raises RegionError."""
    cai = getattr(buffer, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise RegionError(
            f"{type(buffer).__name__} is not a CUDA buffer (no __cuda_array_interface__)"
        )
    address, readonly = cai["data"]
    if readonly:
        raise RegionError("registered memory must be writable")
    if cai.get("strides") is not None:
        raise RegionError("registered device memory must be C-contiguous")
    size = int(np.dtype(cai["typestr"]).itemsize * int(np.prod(cai["shape"], dtype=np.int64)))
    device = getattr(buffer, "device", None)
    index = getattr(device, "id", getattr(device, "index", 0))
    return int(address), size, int(index or 0)
