"""Shared memory: peers on one host. Regions live in POSIX shared-memory segments that peers map
by the name in the descriptor; a read or write is a memcpy out of / into the mapped segment, with
no round trip to the owner per page.

A small control channel per peer pair (an abstract unix socket, so no file to clean up) carries
the hello, notifications and deregistrations, and tells a peer when the other end is gone.
Anyone on the host can connect to an abstract socket, so the owner checks the peer's
credentials (SO_PEERCRED: our own uid by default, `allow_uids` to admit others), then runs the
mutual handshake of session.py (with `secret`, when set: every frame tagged from then on).
Notifications nobody reads are bounded (see `Transport`): past the budget the sender's
connection is dropped. Segments are mode 0600 and named ``tkv-<pid>-<start time>-<random>``, so
`remove_stale_segments` can unlink those whose owner process is gone::

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
from collections.abc import Iterable
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from .args import check_secret
from .base import Direction, Transport
from .crc32c_native import native_crc32c
from .errors import (
    AuthError,
    InvalidInputError,
    PeerError,
    ProtocolError,
    RemoteAccessError,
    TransportError,
)
from .guard import AUTH_REFUSED, BUDGET_HIT, PROTOCOL_ERROR, Audit, PeerCaps
from .handle import BatchHandle
from .regions import Capabilities, Region, RegionDescriptor, TransferOp, as_byte_view
from .segments import remove_stale_segments, segment_name
from .session import HELLO_DEADLINE, Limits, StreamSession

__all__ = ["ShmTransport", "remove_stale_segments", "segment_name"]  # the last two: segments.py

SECRET_ENV = "TIERKV_TRANSPORT_SECRET"
OWNER_ROLE, PEER_ROLE = "shm-owner", "shm-peer"
_MAX_NOTIFY = 1 << 16
#: after the handshake: notify {data <= 64 KiB}, dereg {region}
_LIMITS = Limits(frame=_MAX_NOTIFY + 256, array=4, map=8, str=256, bin=_MAX_NOTIFY)
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


async def _connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # a socket of our own: uvloop refuses abstract addresses given as `path`
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_unix_connection(sock=sock, limit=1 << 14)


def _peer_uid(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket."""
    sock = writer.get_extra_info("socket")
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class ShmTransport(Transport):
    """Same-host transport over POSIX shared memory (Linux).

    Only regions made by `allocate()` or registered as a `SharedMemory` can be targeted by peers;
    any buffer can be the local side of a transfer.

    Args:
        secret: shared secret both ends must prove (default ``$TIERKV_TRANSPORT_SECRET``, if
            set; empty: ValueError). Without one only the uid check guards the socket.
        allow_uids: uids admitted on our control socket besides our own.
        max_preauth: connections that may be at the handshake at once.

    Raises ValueError for an empty secret.
    """

    kind = "shm"
    capabilities = Capabilities(frozenset({"host"}), "native", "host")

    def __init__(
        self,
        name: str | None = None,
        *,
        timeout: float = 30.0,
        secret: bytes | None = None,
        allow_uids: Iterable[int] = (),
        max_preauth: int = 32,
    ) -> None:
        super().__init__(name, timeout=timeout)
        secret = check_secret(secret)
        if secret is None:
            env = os.environ.get(SECRET_ENV)
            if env == "":
                raise InvalidInputError(f"${SECRET_ENV} is empty: an empty secret is not a secret")
            secret = env.encode() if env else b""
        self._secret = secret
        self.allow_uids = {os.getuid(), *allow_uids}
        self.audit = Audit("shm")
        self._preauth = PeerCaps(max_preauth)
        self._address = f"\0tierkv-shm-{self.name}-{secrets.token_hex(6)}"
        self._server: asyncio.AbstractServer | None = None
        self._segments: dict[int, tuple[SharedMemory, bool]] = {}  # region id -> (segment, owned)
        self._maps: dict[tuple[str, int], tuple[str, mmap.mmap, memoryview]] = {}
        self._links: dict[str, tuple[StreamSession, asyncio.Task[None], int]] = {}
        self._inbound: dict[StreamSession, asyncio.Future[None]] = {}  # -> done at its end
        self._dead: set[str] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    # -- regions ---------------------------------------------------------------------------

    def allocate(self, size: int, kind: str = "host") -> Region:
        """A new shared-memory segment of `size` bytes (zeroed), registered; unlinked when it
        is deregistered or the transport closes."""
        seg = SharedMemory(name=segment_name(), create=True, size=max(size, 1))
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
            if not w.writer.is_closing():
                with contextlib.suppress(RuntimeError):  # revoked (write_eof): nothing goes
                    w.write({"op": "dereg", "region": region.region_id})
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
        self._server = await asyncio.start_unix_server(self._on_connect, sock=sock, limit=1 << 14)

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
        session = StreamSession(reader, writer, _LIMITS)
        try:
            await session.client_handshake(
                self._secret, PEER_ROLE, self.name, deadline=self.timeout, expect_role=OWNER_ROLE
            )
            if session.peer_id != agent:
                raise AuthError(f"the owner of {sock!r} is {session.peer_id!r}, not {agent!r}")
        except (TransportError, OSError) as exc:
            session.close()
            if isinstance(exc, AuthError):
                raise
            raise PeerError(f"shm peer {agent!r} did not answer the hello: {exc}") from exc
        except BaseException:
            session.close()
            raise
        self._dead.discard(agent)
        watcher = asyncio.create_task(self._watch(agent, session))
        self._links[agent] = (session, watcher, int(info.get("pid", 0)))

    async def _watch(self, agent: str, session: StreamSession) -> None:
        """Follow the owner's messages on our link; EOF means the peer is gone, or that it
        revoked our writes (`write_fence`): from now on transfers to it are refused, and
        closing our end tells it so (no copy of ours is running while this task runs)."""
        with contextlib.suppress(TransportError):
            while (msg := await session.recv()) is not None:
                region = msg.get("region")
                if msg.get("op") == "dereg" and type(region) is int:
                    self._unmap((agent, region))
        self._dead.add(agent)
        session.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        try:
            pid, uid = _peer_uid(writer)
        except (OSError, struct.error):
            pid, uid = 0, -1
        who = f"pid {pid} uid {uid}"
        if uid not in self.allow_uids:
            self.audit.note(AUTH_REFUSED, who, "uid not allowed")
            writer.close()
            return
        if not self._preauth.admit(str(uid)):
            self.audit.note(BUDGET_HIT, who, "preauth_per_peer")
            writer.close()
            return
        preauth = True
        if task is not None:
            self._handlers.add(task)
        session = StreamSession(reader, writer, _LIMITS)
        try:
            await session.serve_handshake(
                self._secret, OWNER_ROLE, self.name, deadline=min(self.timeout, HELLO_DEADLINE)
            )
            self._preauth.release(str(uid))
            preauth = False
            self._inbound[session] = asyncio.get_running_loop().create_future()
            while (msg := await session.recv()) is not None:
                data = msg.get("data")
                if not isinstance(data, bytes) or msg.get("op") != "notify":
                    continue
                if not self.deliver_notification(session.peer_id, data):
                    self.audit.note(BUDGET_HIT, who, "notifications", agent=session.peer_id)
                    return
        except AuthError as exc:
            self.audit.note(
                AUTH_REFUSED if preauth else PROTOCOL_ERROR,
                who,
                "bad proof" if preauth else "bad tag",
                detail=exc,
            )
        except ProtocolError as exc:
            self.audit.note(PROTOCOL_ERROR, who, "malformed", detail=exc)
        except TransportError:  # the hello deadline
            self.audit.note(BUDGET_HIT, who, "hello_deadline")
        except (TimeoutError, ConnectionError):
            pass
        finally:
            if preauth:
                self._preauth.release(str(uid))
            ended = self._inbound.pop(session, None)
            session.close()
            if ended is not None and not ended.done():
                ended.set_result(None)
            if task is not None:
                self._handlers.discard(task)

    def write_fence(self, agent: str | None) -> asyncio.Future[None]:
        """Revoke ``agent``'s writes (None: every peer's): half-close its links to us; done
        once it has closed its end (its transport saw the revocation between two copies, and
        refuses transfers to us from then on) or is gone. A peer copies into our segment
        without us, so its own transport is what stops it; a revoked peer links again (a new
        `add_peer`) to transfer again."""
        mine = [(s, f) for s, f in self._inbound.items() if agent is None or s.peer_id == agent]
        for session, _ in mine:
            with contextlib.suppress(OSError, RuntimeError):
                session.writer.write_eof()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not mine:
            done.set_result(None)  # no link: its transport refuses transfers to us
            return done
        waiting = asyncio.gather(*(f for _, f in mine))

        def drained(_: object) -> None:
            if not done.done():
                done.set_result(None)

        waiting.add_done_callback(drained)
        return done

    def _check_alive(self, agent: str) -> StreamSession:
        link = self._links.get(agent)
        if link is None or agent in self._dead or link[0].writer.is_closing():
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
        handle: BatchHandle,
    ) -> None:
        links = {agent: self._check_alive(agent) for agent in {op.remote.agent for op in ops}}
        crc = native_crc32c() if handle.want_sums else None
        sums: list[int] = []
        for local, lo, remote, ro, n in ops:
            theirs = self._map(remote)
            if ro + n > len(theirs):
                raise RemoteAccessError(f"[{ro}, {ro + n}) is outside {remote}")
            if direction == "read":
                local.view[lo : lo + n] = theirs[ro : ro + n]
                if crc is not None:  # each op's bytes right after its copy, still in cache
                    sums.append(crc(local.view[lo : lo + n], 0))
            else:
                theirs[ro : ro + n] = local.view[lo : lo + n]
        if crc is not None:
            handle.sums = sums
        if notify is not None:
            for agent, session in links.items():
                try:
                    await session.send({"op": "notify", "data": bytes(notify)})
                except ConnectionError as exc:
                    raise PeerError(f"shm peer {agent!r} vanished before the notification") from exc

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for session, watcher, _ in self._links.values():
            session.close()
            watcher.cancel()
        for w in list(self._inbound):
            w.close()  # their handlers end, and with them any fence waiting on them
        pending = [link[1] for link in self._links.values()] + list(self._handlers)
        await asyncio.gather(*pending, return_exceptions=True)
        self._links.clear()
        for key in list(self._maps):
            self._unmap(key)
