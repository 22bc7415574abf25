"""The NIXL side of `NixlTransport`: loading NIXL, agents whose progress thread is paced, the
error mapping, and the engine thread that posts transfers, polls them with a backoff and
drains notifications, so that the event loop never blocks on NIXL. See ``nixl.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from .errors import (
    PeerError,
    RemoteAccessError,
    TransferTimeoutError,
    TransportError,
)

__all__ = [
    "DEREG_TAG",
    "HELLO_TAG",
    "NOTE_TAG",
    "START_TIMEOUT_S",
    "NixlEngine",
    "NixlJob",
    "agent_name",
    "load_nixl",
    "new_agent",
]

NOTE_TAG, DEREG_TAG, HELLO_TAG = b"\x01", b"\x02", b"\x03"
_MIN_WAIT, _MAX_WAIT, _NOTE_WAIT, _IDLE_WAIT = 20e-6, 1e-3, 4e-3, 20e-3

START_TIMEOUT_S = 60.0
_STOP = object()


_BINDINGS_LOCK = threading.Lock()


class _PacedBindings:
    """NIXL's binding module, except that agents get `pthrDelay` = `delay_us`.

    NIXL's Python API hard-codes ``pthrDelay = 0``, with which UCX's progress thread polls its
    workers with a zero timeout: one core spinning per agent, idle or not (measured: half of a
    loaded 2-core host per agent). With a delay the thread sleeps in poll() on the workers' event
    fds and wakes on traffic, or after the delay (rounded up to whole ms) at the latest.
    """

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings, self._delay_us = bindings, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the bindings name it so
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def new_agent(api: ModuleType, name: str, config: Any, delay_us: int) -> Any:
    """`api.nixl_agent(name, config)` with the progress thread's poll delay set."""
    with _BINDINGS_LOCK:  # the swap is module-global: one construction at a time
        bindings = api.nixlBind
        api.nixlBind = _PacedBindings(bindings, delay_us)  # type: ignore[attr-defined]
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = bindings  # type: ignore[attr-defined]


def load_nixl() -> ModuleType:
    """The NIXL Python API module (``nixl._api`` of whichever variant is installed).

    Raises TransportError (from the ImportError) when NIXL is not installed.
    """
    errors: list[str] = []
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs INFO lines to stdout otherwise
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise TransportError(
        "the nixl transport needs NIXL: pip install --no-deps nixl-cu12 (" + "; ".join(errors) + ")"
    )


def agent_name(value: Any) -> str:
    """An agent name as NIXL returns it (bytes or str) as a str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _map_error(exc: BaseException, peer: str) -> TransportError:
    """A NIXL binding exception as one of ours (the bindings' classes are named nixl*Error)."""
    kind = type(exc).__name__
    if kind == "nixlNotFoundError":
        return RemoteAccessError(f"peer {peer!r} has no registered memory covering the ranges")
    if kind in ("nixlRemoteDisconnectError", "nixlBackendError"):
        return PeerError(f"nixl peer {peer!r} is gone or unreachable ({exc})")
    if kind == "nixlInvalidParamError":
        return RemoteAccessError(f"nixl refused the descriptors for peer {peer!r} ({exc})")
    return PeerError(f"nixl transfer with {peer!r} failed: {kind} {exc}")


@dataclass(slots=True, eq=False)
class NixlJob:
    """One NIXL transfer: posted from the loop, polled on the engine thread, aborted from the loop.

    `local` / `remote`: (NIXL segment, N x 3 uint64 array of address, length, device id).
    `sections`: the partial metadata of the remote regions it touches (loaded on first use).
    """

    op: str
    peer: str
    local: tuple[str, np.ndarray]
    remote: tuple[str, np.ndarray]
    sections: list[bytes]
    note: bytes
    future: asyncio.Future[None] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    handle: Any = None
    done: bool = False

    def __post_init__(self) -> None:
        self.future = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(_retrieve)  # a sibling's failure may leave it unawaited


class NixlEngine(threading.Thread):
    """The thread that posts and polls NIXL transfers and drains notifications."""

    def __init__(self, agent: Any, on_note: Callable[[str, bytes], None]) -> None:
        super().__init__(name=f"nixl-engine-{agent.name}", daemon=True)
        self.agent = agent
        self.on_note = on_note
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.note_waiters = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._active: list[NixlJob] = []
        self._leaked: list[Any] = []  # handles NIXL could not cancel: polled until they finish
        self._sections: set[bytes] = set()
        self.known: set[str] = set()  # agents whose full metadata is loaded

    # -- called from the event loop ------------------------------------------------------------

    def submit(self, item: Any) -> None:
        """Queue a callable to run on this thread."""
        self._queue.put(item)

    def post(self, job: NixlJob) -> None:
        """Build and post `job`'s NIXL transfer (from the loop); if it is still in progress,
        the thread polls it. Errors settle `job.future`."""
        if self._begin(job):
            self._queue.put(job)

    async def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run `fn()` on this thread; its result or exception. Raises TransferTimeoutError."""
        future: asyncio.Future[Any] = self.loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                self._settle(future, exc)
            else:
                self.loop.call_soon_threadsafe(_set_result, future, result)

        self.submit(run)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise TransferTimeoutError(f"nixl call not done after {timeout:g} s") from None

    def watch_notes(self, delta: int) -> None:
        """Count a waiter for notifications in (+1) or out (-1); polled only while any waits."""
        self.note_waiters += delta
        if delta > 0:
            self.submit(None)  # wake the thread

    def abort(self, job: NixlJob) -> None:
        """Stop `job` (cancel its NIXL transfer); once this returns, none of its bytes land."""
        with job.lock:
            if job.done:
                return
            job.done = True
            self._release(job.handle)

    def forget_sections(self) -> None:
        """Drop the record of loaded remote sections (their agent was removed)."""
        self._sections.clear()

    def stop(self) -> None:
        """Ask the thread to abort what is in flight and exit."""
        self._queue.put(_STOP)

    # -- the thread ----------------------------------------------------------------------------

    def run(self) -> None:
        wait = _MIN_WAIT
        while True:
            busy = self._active or self._leaked
            limit = wait if busy else (_NOTE_WAIT if self.note_waiters else _IDLE_WAIT)
            items = []
            try:
                items.append(self._queue.get(timeout=limit))
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            progressed = False
            for item in items:
                if item is _STOP:
                    self._shutdown()
                    return
                if isinstance(item, NixlJob):
                    self._active.append(item)
                    progressed = True
                elif item is not None:
                    item()
            for job in list(self._active):
                progressed |= self._poll(job)
            if self._leaked:
                self._poll_leaked()
            progressed |= self._drain_notes()
            wait = _MIN_WAIT if progressed else min(wait * 2, _MAX_WAIT)

    def _begin(self, job: NixlJob) -> bool:
        """Post; True while the transfer is in progress."""
        a = self.agent
        with job.lock:
            if job.done:
                return False
            try:
                for md in job.sections:
                    if md not in self._sections:
                        if agent_name(a.add_remote_agent(md)) != job.peer:
                            raise RemoteAccessError(f"descriptor metadata is not {job.peer!r}'s")
                        self._sections.add(md)
                local = a.get_xfer_descs(job.local[1], job.local[0])
                remote = a.get_xfer_descs(job.remote[1], job.remote[0])
                job.handle = a.initialize_xfer(job.op, local, remote, job.peer, job.note)
                state = a.transfer(job.handle)
            except Exception as exc:
                self._finish(job, exc)
                return False
            if state == "PROC":
                return True
            failed = PeerError(f"nixl transfer with {job.peer!r} failed")
            self._finish(job, None if state == "DONE" else failed)
            return False

    def _poll(self, job: NixlJob) -> bool:
        with job.lock:
            if job.done:  # aborted from the loop
                self._active.remove(job)
                return True
            try:
                state = self.agent.check_xfer_state(job.handle)
            except Exception as exc:
                state, error = "ERR", exc
            else:
                error = PeerError(f"nixl transfer with {job.peer!r} failed")
            if state == "PROC":
                return False
            self._active.remove(job)
            self._finish(job, None if state == "DONE" else error)
            return True

    def _finish(self, job: NixlJob, exc: BaseException | None) -> None:
        """Release the job's NIXL handle and settle its future (job.lock held)."""
        job.done = True
        self._release(job.handle)
        if exc is not None and not isinstance(exc, TransportError):
            exc = _map_error(exc, job.peer)
        self._settle(job.future, exc)

    def _settle(self, future: asyncio.Future[Any], exc: BaseException | None) -> None:
        if threading.get_ident() == self.loop_thread:  # posted and done in place
            _set_outcome(future, exc)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
            self.loop.call_soon_threadsafe(_set_outcome, future, exc)

    def _release(self, handle: Any) -> None:
        if handle is None:
            return
        try:
            handle.release()
        except Exception:  # still running and not cancellable: keep polling it
            self._leaked.append(handle)

    def _poll_leaked(self) -> None:
        for handle in list(self._leaked):
            with contextlib.suppress(Exception):
                if self.agent.check_xfer_state(handle) == "PROC":
                    continue
            with contextlib.suppress(Exception):
                handle.release()
                self._leaked.remove(handle)

    def _drain_notes(self) -> bool:
        try:
            notes = self.agent.get_new_notifs()
        except Exception:
            return False
        for peer, messages in notes.items():
            name = agent_name(peer)
            for msg in messages:
                if msg[:1] == HELLO_TAG and name not in self.known:
                    self._hello(name, bytes(msg[1:]))
                elif msg[:1] in (NOTE_TAG, DEREG_TAG):  # else: another NIXL user's message
                    self.loop.call_soon_threadsafe(self.on_note, name, bytes(msg))
        return bool(notes)

    def _hello(self, sender: str, metadata: bytes) -> None:
        """Load the metadata a new initiator sent, so that we can announce deregistrations."""
        try:
            loaded = agent_name(self.agent.add_remote_agent(metadata))
        except Exception:
            return  # malformed, or an agent of that name is loaded already
        if loaded == sender:
            self.known.add(sender)
        elif loaded not in self.known:  # someone else's metadata: not ours to keep
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(loaded)

    def _shutdown(self) -> None:
        for job in self._active:
            self.abort(job)
            self._settle(job.future, PeerError("nixl transport closed"))
        self._active.clear()
        for _ in range(1000):  # handles NIXL could not cancel at once: give them 1 s
            if not self._leaked:
                break
            self._poll_leaked()
            threading.Event().wait(_MAX_WAIT)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_outcome(future: asyncio.Future[Any], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
