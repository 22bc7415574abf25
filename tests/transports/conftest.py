"""Fixtures for the transport tests. Every async test runs under asyncio (debug mode) and uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from transports import RegionDescriptor


def _asyncio_debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    return loop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": _asyncio_debug_loop}
    try:
        import uvloop
    except ImportError:
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories


ROOT = Path(__file__).resolve().parents[2]


class PeerProcess:
    """A peer transport in a child process (see peer_proc.py)."""

    def __init__(self, proc: asyncio.subprocess.Process, meta: bytes, desc: RegionDescriptor):
        self.proc = proc
        self.meta = meta
        self.desc = desc

    async def ask(self, command: str, timeout: float = 5.0) -> list[str]:
        """Send one command line; the words of the reply line."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        return line.decode().split()


@asynccontextmanager
async def spawn_peer(
    backend: str, size: int, seed: int, secret: bytes | None = None, script: str = "peer_proc.py"
) -> AsyncIterator[PeerProcess]:
    """Start a peer process; on exit kill it, reap it and unlink its shared-memory segment."""
    args = [sys.executable, str(Path(__file__).with_name(script)), backend, str(size), str(seed)]
    if secret is not None:
        args.append(secret.hex())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=PIPE, stdout=PIPE, stderr=subprocess.DEVNULL, env=env
    )
    desc: RegionDescriptor | None = None
    try:
        assert proc.stdout is not None
        words = (await asyncio.wait_for(proc.stdout.readline(), 10.0)).decode().split()
        assert words and words[0] == "READY", f"peer failed to start: {words}"
        desc = RegionDescriptor.unpack(bytes.fromhex(words[2]))
        yield PeerProcess(proc, bytes.fromhex(words[1]), desc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10.0)
        if desc is not None and desc.handle:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{desc.handle}")


@pytest.fixture
def peer_process() -> Callable[..., Any]:
    """`spawn_peer`, as a fixture."""
    return spawn_peer
