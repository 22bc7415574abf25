"""Shared memory: peers on one host. Regions live in POSIX shared-memory segments that peers map
by the name in the descriptor; a read or write is a memcpy out of / into the mapped segment, with
no round trip to the owner per page.

A small control channel per peer pair (an abstract unix socket, so no file to clean up) carries
the hello, notifications and deregistrations, and tells a peer when the other end is gone::

    initiator                               owner ("b")
    ┌──────────────┐   mmap /dev/shm/tkv-…  ┌──────────────┐
    │ local region │ <======== memcpy ====> │ shm segment  │
    └──────────────┘                        └──────────────┘
          └──── unix socket: hello / notify ────>  │
          <──────────────── dereg, EOF ────────────┘
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import secrets
import socket
import struct
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgpack

from .base import Direction, Transport
from .errors import PeerError, ProtocolError, RemoteAccessError
from .handle import TransferHandle
from .regions import Capabilities, Region, RegionDescriptor, TransferOp, as_byte_view

__all__ = ["ShmTransport"]

_LEN = struct.Struct("!I")
_MAX_MSG = 1 << 20
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")


async def _send(writer: asyncio.StreamWriter, obj: Any) -> None:
    body = msgpack.packb(obj)
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> Any:
    """The next message, or None at EOF. Raises ProtocolError on a bad frame."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(4))
        if n > _MAX_MSG:
            raise ProtocolError(f"control message of {n} bytes")
        return msgpack.unpackb(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError("malformed control message") from exc


async def _connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # a socket of our own: uvloop refuses abstract addresses given as `path`
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_unix_connection(sock=sock)


class ShmTransport(Transport):
    """Same-host transport over POSIX shared memory (Linux).

    Only regions made by `allocate()` or registered as a `SharedMemory` can be targeted by peers;
    any buffer can be the local side of a transfer.
    """

    kind = "shm"
    capabilities = Capabilities(frozenset({"host"}), "native", "host")

    def __init__(self, name: str | None = None, *, timeout: float = 30.0) -> None:
        super().__init__(name, timeout=timeout)
        self._address = f"\0tierkv-shm-{self.name}-{secrets.token_hex(6)}"
        self._server: asyncio.AbstractServer | None = None
        self._segments: dict[int, tuple[SharedMemory, bool]] = {}  # region id -> (segment, owned)
        self._maps: dict[tuple[str, int], tuple[str, mmap.mmap, memoryview]] = {}
        self._links: dict[str, tuple[asyncio.StreamWriter, asyncio.Task[None], int]] = {}
        self._inbound: set[asyncio.StreamWriter] = set()
        self._dead: set[str] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    # -- regions ---------------------------------------------------------------------------

    def allocate(self, size: int, kind: str = "host") -> Region:
        """A new shared-memory segment of `size` bytes (zeroed), registered; unlinked when it
        is deregistered or the transport closes."""
        seg = SharedMemory(name=f"tkv-{secrets.token_hex(8)}", create=True, size=max(size, 1))
        try:
            region = self.register_memory(seg, kind)
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        self._segments[region.region_id] = (seg, True)
        return region

    def _prepare_region(self, buffer: Any, region_id: int) -> tuple[memoryview, str]:
        if not isinstance(buffer, SharedMemory):
            return as_byte_view(buffer), ""  # local-only: peers cannot map it
        self._segments[region_id] = (buffer, False)
        view = buffer.buf
        assert view is not None
        return as_byte_view(view), buffer.name

    def _on_deregister(self, region: Region) -> None:
        for w in list(self._inbound):
            if not w.is_closing():
                body = msgpack.packb({"op": "dereg", "region": region.region_id})
                w.write(_LEN.pack(len(body)) + body)
        seg, owned = self._segments.pop(region.region_id, (None, False))
        if seg is None or not owned:  # a caller's SharedMemory stays theirs to close
            return
        with contextlib.suppress(BufferError):  # caller still holds views: leave it mapped
            region.view.release()
            seg.close()
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()

    def _map(self, desc: RegionDescriptor) -> memoryview:
        key = (desc.agent, desc.region_id)
        hit = self._maps.get(key)
        if hit is not None and hit[0] == desc.handle:
            return hit[2]
        if not desc.handle:
            raise RemoteAccessError(f"{desc} is not in shared memory (use allocate())")
        if not _SEGMENT.fullmatch(desc.handle) or ".." in desc.handle:
            raise RemoteAccessError(f"bad segment name {desc.handle!r}")
        try:
            fd = os.open(f"/dev/shm/{desc.handle}", os.O_RDWR)
        except OSError as exc:
            raise RemoteAccessError(f"segment of {desc} is gone") from exc
        try:
            size = os.fstat(fd).st_size
            if size < desc.size or size == 0:
                raise RemoteAccessError(f"segment of {desc} has only {size} bytes")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._unmap(key)
        view = memoryview(mm)
        self._maps[key] = (desc.handle, mm, view)
        return view

    def _unmap(self, key: tuple[str, int]) -> None:
        hit = self._maps.pop(key, None)
        if hit is not None:
            hit[2].release()
            with contextlib.suppress(BufferError):
                hit[1].close()

    # -- control channel -----------------------------------------------------------------------

    async def _start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # abstract: no file to remove
        sock.bind(self._address)
        self._server = await asyncio.start_unix_server(self._on_connect, sock=sock)

    def _peer_fields(self) -> dict[str, Any]:
        return {"sock": self._address, "pid": os.getpid(), "host": os.uname().nodename}

    async def _add_peer(self, info: dict[str, Any]) -> None:
        agent, sock = info["agent"], info.get("sock")
        if info.get("host") != os.uname().nodename or not isinstance(sock, str):
            raise PeerError(f"shm peer {agent!r} is not on this host")
        old = self._links.pop(agent, None)
        if old is not None:
            old[0].close()
            old[1].cancel()
        try:
            reader, writer = await asyncio.wait_for(_connect(sock), self.timeout)
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"cannot reach shm peer {agent!r}") from exc
        await _send(writer, {"op": "hello", "agent": self.name})
        reply = await asyncio.wait_for(_recv(reader), self.timeout)
        if not isinstance(reply, dict) or reply.get("agent") != agent:
            writer.close()
            raise PeerError(f"shm peer {agent!r} did not answer the hello")
        self._dead.discard(agent)
        watcher = asyncio.create_task(self._watch(agent, reader))
        self._links[agent] = (writer, watcher, int(info.get("pid", 0)))

    async def _watch(self, agent: str, reader: asyncio.StreamReader) -> None:
        """Follow the owner's messages on our link; EOF means the peer is gone."""
        with contextlib.suppress(ProtocolError):
            while (msg := await _recv(reader)) is not None:
                if isinstance(msg, dict) and msg.get("op") == "dereg":
                    self._unmap((agent, msg.get("region", -1)))
        self._dead.add(agent)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            hello = await asyncio.wait_for(_recv(reader), self.timeout)
            if not isinstance(hello, dict) or not isinstance(hello.get("agent"), str):
                return
            await _send(writer, {"op": "welcome", "agent": self.name})
            self._inbound.add(writer)
            while (msg := await _recv(reader)) is not None:
                if isinstance(msg, dict) and msg.get("op") == "notify":
                    data = msg.get("data")
                    if isinstance(data, bytes):
                        self._deliver(hello["agent"], data)
        except (ProtocolError, TimeoutError, ConnectionError):
            pass
        finally:
            self._inbound.discard(writer)
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _check_alive(self, agent: str) -> asyncio.StreamWriter:
        link = self._links.get(agent)
        if link is None or agent in self._dead or link[0].is_closing():
            raise PeerError(f"shm peer {agent!r} is gone")
        try:
            os.kill(link[2], 0)
        except ProcessLookupError:
            self._dead.add(agent)
            raise PeerError(f"shm peer {agent!r} (pid {link[2]}) is gone") from None
        except PermissionError:
            pass
        return link[0]

    # -- transfers -----------------------------------------------------------------------------

    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: TransferHandle,
    ) -> None:
        links = {agent: self._check_alive(agent) for agent in {op.remote.agent for op in ops}}
        for local, lo, remote, ro, n in ops:
            theirs = self._map(remote)
            if ro + n > len(theirs):
                raise RemoteAccessError(f"[{ro}, {ro + n}) is outside {remote}")
            if direction == "read":
                local.view[lo : lo + n] = theirs[ro : ro + n]
            else:
                theirs[ro : ro + n] = local.view[lo : lo + n]
        if notify is not None:
            for agent, writer in links.items():
                try:
                    await _send(writer, {"op": "notify", "data": bytes(notify)})
                except ConnectionError as exc:
                    raise PeerError(f"shm peer {agent!r} vanished before the notification") from exc

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer, watcher, _ in self._links.values():
            writer.close()
            watcher.cancel()
        for w in list(self._inbound):
            w.close()
        pending = [link[1] for link in self._links.values()] + list(self._handlers)
        await asyncio.gather(*pending, return_exceptions=True)
        self._links.clear()
        for key in list(self._maps):
            self._unmap(key)
